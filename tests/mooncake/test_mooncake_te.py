"""Mooncake's Transfer Engine API on kvplugins.transfer (kvplugins/mooncake/te.py, issue #36): one script
(te_script.py: two processes, P2PHANDSHAKE over TCP on loopback, byte-checked reads and writes, sync, async,
submit/check, notify, managed buffers) gives the same codes and bytes on ours and on the real Mooncake 0.3.13
wheel; what ours refuses where Mooncake would read past a buffer, or crash, returns its code and moves nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from helpers.router_feeds import free_port, until

from kvplugins.mooncake import te, te_device

SCRIPT = Path(__file__).with_name("te_script.py")
EXPECTED = {  # the real wheel's answers (test_the_script_gives_the_same_answers_on_real_mooncake)
    "init": 0, "register": 0, "read": 0, "read_bytes": True, "write": 0, "write_bytes": True, "batch_read": 0,
    "batch_read_bytes": True, "batch_write": 0, "batch_write_bytes": True, "batch16_read": 0,
    "batch16_read_bytes": True, "batch16_write": 0, "batch16_write_bytes": True, "async_id": True, "async_status": 0,
    "async_bytes": True, "async_opcode_status": 0, "submit_id": True, "check_status": 1, "submit_bytes": True,
    "first_buffer": True, "notify": 0, "notifies": [["driver", "done-1"]], "sizes_differ": -1, "unknown_peer": -1,
    "managed": True, "write_bytes_to_buffer": 0, "read_bytes_from_buffer": True, "free_managed": 0, "unregister": 0,
}  # fmt: skip


def _run(impl: str, *prefix: str) -> dict:
    proc = subprocess.run([*prefix, sys.executable, str(SCRIPT), impl], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_script_runs_on_ours():
    assert _run("ours") == EXPECTED


def test_the_script_gives_the_same_answers_on_real_mooncake():
    pytest.importorskip("mooncake.engine")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("the real wheel binds 0.0.0.0: it runs in a private network namespace (root, unshare)")
    assert _run("real", "unshare", "-n") == EXPECTED


@pytest.fixture
def pair():
    """Two of our engines in this process, each with 64 KiB registered: (a, b, a's buffer, b's buffer, b's name)."""
    a, b = te.TransferEngine(), te.TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1:0", "P2PHANDSHAKE", "tcp", "") == 0
    abuf, bbuf = np.zeros(1 << 16, np.uint8), np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)
    assert (
        a.register_memory(abuf.ctypes.data, abuf.nbytes) == 0 and b.register_memory(bbuf.ctypes.data, bbuf.nbytes) == 0
    )
    yield a, b, abuf, bbuf, f"127.0.0.1:{b.get_rpc_port()}"
    a.close()
    b.close()


def test_what_ours_refuses_moves_nothing(pair):
    """Spans past the peer's buffers (Mooncake's TCP transport reads whatever lies there) or in local memory not
    registered, a malformed name, an unknown batch id: the call's failure code, and not a byte moved."""
    a, b, abuf, bbuf, name = pair
    base = bbuf.ctypes.data
    assert a.transfer_sync_read(name, abuf.ctypes.data, base + bbuf.nbytes - 8, 16) == -1  # runs past its end
    assert a.transfer_sync_write(name, abuf.ctypes.data, base - 4096, 16) == -1  # before it
    stray = np.ones(64, np.uint8)
    assert a.transfer_sync_read(name, stray.ctypes.data, base, 64) == -1  # our buffer is not registered
    la, many = abuf.ctypes.data, [1024 * j for j in range(12)]  # the many-buffer form (the core's array form)
    assert (
        a.batch_transfer_sync_read(name, [la + o for o in many], [base + o for o in many[:-1]] + [base - 64], [64] * 12)
        == -1
    )
    assert (
        a.batch_transfer_sync_write(name, [la + o for o in many], [base + o for o in many], [64] * 11 + [1 << 20]) == -1
    )
    assert (
        a.batch_transfer_sync_read(
            name, [la + o for o in many[:-1]] + [stray.ctypes.data], [base + o for o in many], [64] * 12
        )
        == -1
    )
    assert not abuf.any() and stray.all() and np.array_equal(bbuf, np.arange(1 << 16, dtype=np.uint64).astype(np.uint8))
    for bad in ("nohost", "127.0.0.1:0", "127.0.0.1:x", 7):
        assert a.transfer_sync_read(bad, abuf.ctypes.data, base, 16) == -1
    assert a.batch_transfer_async_read(name, [abuf.ctypes.data], [base + (1 << 16)], [1]) == 0
    assert a.transfer_submit_write(name, abuf.ctypes.data, base - 1, 1) == -1
    assert a.transfer_check_status(12345) == -1 and a.get_batch_transfer_status([12345]) == -1
    assert a.unregister_memory(abuf.ctypes.data + 1) == -1 and a.free_managed_buffer(abuf.ctypes.data, 16) == -1
    with pytest.raises(ValueError, match="not inside registered memory"):
        a.read_bytes_from_buffer(stray.ctypes.data, 8)
    assert a.write_bytes_to_buffer(stray.ctypes.data, b"x" * 8, 8) == -1 and stray.all()


def test_a_buffer_the_peer_registers_later_is_found_and_one_it_dropped_is_refused(pair):
    """A segment is asked again when an address is not in the cached one. A buffer the peer dropped is refused
    once the segment is asked again (send_probe); until then a one-sided same-host path (cma, as Mooncake's
    shm/RDMA with a cached segment) may still reach it: the peer must not drop memory a transfer may target."""
    a, b, abuf, bbuf, name = pair
    assert a.transfer_sync_read(name, abuf.ctypes.data, bbuf.ctypes.data, 64) == 0  # the peer's segment is cached
    later = np.full(4096, 9, np.uint8)
    assert b.register_memory(later.ctypes.data, later.nbytes) == 0
    assert a.transfer_sync_read(name, abuf.ctypes.data, later.ctypes.data, 4096) == 0  # asked again, found
    assert (abuf[:4096] == 9).all()
    assert b.unregister_memory(later.ctypes.data) == 0 and a.send_probe(name) == 0
    abuf[:] = 0
    assert a.transfer_sync_read(name, abuf.ctypes.data, later.ctypes.data, 4096) == -1  # the peer refuses it now
    assert not abuf.any()


def test_calls_before_initialize_and_other_metadata_modes_are_refused_by_code():
    e = te.TransferEngine()
    assert e.register_memory(4096, 16) == -1 and e.get_rpc_port() == -1
    assert (
        e.transfer_sync_read("127.0.0.1:1", 4096, 4096, 16) == -1
        and e.batch_transfer_async_read("a:1", [], [], []) == 0
    )
    assert e.allocate_managed_buffer(4096) == 0 and e.get_notifies() == []
    assert e.initialize("127.0.0.1", "redis://127.0.0.1:6379", "tcp", "") == -1  # not served
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # once
    assert e.get_rpc_port() > 0 and json.loads(e.get_local_topology())["transports"][-1] == "tcp"
    e.close()


def test_the_shim_serves_mooncake_engine_with_names_the_wheel_has(tmp_path):
    from helpers.shims import shim_probe
    from kvplugins.mooncake import shim as mooncake_shim

    real = pytest.importorskip("mooncake.engine")
    probe = (
        "import mooncake.engine as m; "
        "print(m.TransferEngine.__module__, int(m.Write), *sorted(n for n in dir(m) if n[0] != '_'))"
    )
    out = shim_probe(mooncake_shim.SHIM, tmp_path, probe)
    assert out[0] == "kvplugins.mooncake.te" and out[1] == str(int(real.TransferOpcode.Write))
    assert {"TransferEngine", "TransferOpcode", "TransferNotify", "Read", "Write"} <= set(out[2:]) <= set(dir(real))
    ours = {n for n in dir(te.TransferEngine) if not n.startswith("_")} - {"close", "stats"}  # our two additions
    assert ours <= set(dir(real.TransferEngine))


def test_etcd_metadata_mode_names_segments_freely_and_frees_a_name_on_close():
    from helpers.etcd import etcd_server

    with etcd_server() as etcd:
        url = etcd.endpoint + "/te-names"
        a, b, dup = te.TransferEngine(), te.TransferEngine(), te.TransferEngine()
        try:
            assert a.initialize("127.0.0.1", url, "tcp", "") == 0
            assert (
                b.initialize("decode-0", url.removeprefix("etcd://"), "tcp", "") == 0
            )  # host:port = etcd, as Mooncake
            assert dup.initialize("decode-0", url, "tcp", "") == -1  # a live process holds the name
            abuf, bbuf = np.zeros(4096, np.uint8), np.full(4096, 7, np.uint8)
            assert a.register_memory(abuf.ctypes.data, 4096) == 0 and b.register_memory(bbuf.ctypes.data, 4096) == 0
            assert a.transfer_sync_read("decode-0", abuf.ctypes.data, bbuf.ctypes.data, 4096) == 0
            assert (abuf == 7).all()
            assert a.get_first_buffer_address("decode-0") == bbuf.ctypes.data
            assert a.transfer_sync_read("nobody", abuf.ctypes.data, bbuf.ctypes.data, 4096) == -1
            b.close()
            assert dup.initialize("decode-0", url, "tcp", "") == 0  # the name is free again
        finally:
            for e in (a, b, dup):
                e.close()
        assert te.TransferEngine().initialize("x", "redis://127.0.0.1:6379", "tcp", "") == -1


def test_http_metadata_mode_on_mooncakes_own_http_metadata_server():
    """Segment names kept in the real wheel's ``mooncake_http_metadata_server`` under the key and JSON Mooncake
    writes; a live name refused, a dead process's entry replaced, a closed engine's deleted."""
    pytest.importorskip("mooncake.http_metadata_server")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metadata"

    def entry(name: str) -> dict | None:
        try:
            with urllib.request.urlopen(f"{url}?key=mooncake%2Frpc_meta%2F{name}", timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            assert e.code == 404
            return None

    a, b, dup, late = te.TransferEngine(), te.TransferEngine(), te.TransferEngine(), te.TransferEngine()
    try:
        until(lambda: _answers(url), "the metadata server to listen")
        assert a.initialize("127.0.0.1", url, "tcp", "") == 0 and b.initialize("decode-0", url, "tcp", "") == 0
        assert entry("decode-0") == {"ip_or_host_name": "127.0.0.1", "rpc_port": b.get_rpc_port()}
        assert dup.initialize("decode-0", url, "tcp", "") == -1  # a live process holds the name
        abuf, bbuf = np.zeros(4096, np.uint8), np.full(4096, 5, np.uint8)
        assert a.register_memory(abuf.ctypes.data, 4096) == 0 and b.register_memory(bbuf.ctypes.data, 4096) == 0
        assert a.transfer_sync_read("decode-0", abuf.ctypes.data, bbuf.ctypes.data, 4096) == 0 and (abuf == 5).all()
        assert a.transfer_sync_read("nobody", abuf.ctypes.data, bbuf.ctypes.data, 4096) == -1
        dead = json.dumps({"ip_or_host_name": "127.0.0.1", "rpc_port": free_port()}).encode()  # nothing listens
        put = urllib.request.Request(f"{url}?key=mooncake%2Frpc_meta%2Fprefill-0", data=dead, method="PUT")
        urllib.request.urlopen(put, timeout=5).read()
        assert late.initialize("prefill-0", url, "tcp", "") == 0  # a dead process's entry is replaced
        assert entry("prefill-0")["rpc_port"] == late.get_rpc_port()
        b.close()
        assert entry("decode-0") is None  # given up on close
    finally:
        for e in (a, b, dup, late):
            e.close()
        server.terminate()
        server.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}?key=probe", timeout=2).read()
    except urllib.error.HTTPError:
        return True  # 404: it answers
    except OSError:
        return False
    return True


@pytest.fixture
def device_pair(monkeypatch):
    """As ``pair``, with b's buffer registered as CUDA device memory ("cuda:0"), emulated (transfer config
    device_emulation: host memory copied only through the device copy functions, as a GPU's would be; this
    machine has no GPU, tests/gpu/ runs the same with CUDA memory)."""
    monkeypatch.setenv("KVPLUGINS_TRANSFER_DEVICE_EMULATION", "1")
    a, b = te.TransferEngine(), te.TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    abuf, bdev = np.zeros(1 << 16, np.uint8), np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)
    assert a.register_memory(abuf.ctypes.data, abuf.nbytes, "cpu:0") == 0
    assert b.register_memory(bdev.ctypes.data, bdev.nbytes, "cuda:0") == 0
    yield a, b, abuf, bdev
    a.close()
    b.close()


def test_a_peers_device_buffer_is_served_over_tcp_staged_by_its_server(device_pair):
    a, b, abuf, bdev = device_pair
    name = f"127.0.0.1:{b.get_rpc_port()}"
    want = bdev[100:4196].copy()
    assert a.transfer_sync_read(name, abuf.ctypes.data, bdev.ctypes.data + 100, 4096) == 0
    assert np.array_equal(abuf[:4096], want)
    abuf[:8192] = 7
    spans = [(0, 3000), (5000, 2000)]  # two buffers into the device buffer, one batch
    rc = a.batch_transfer_sync_write(
        name,
        [abuf.ctypes.data + o for o, _ in spans],
        [bdev.ctypes.data + 9000 + o for o, _ in spans],
        [n for _, n in spans],
    )
    assert rc == 0 and (bdev[9000:12000] == 7).all() and (bdev[14000:16000] == 7).all()
    assert bdev[12000] == np.uint8(12000 % 256)  # nothing between the spans
    stats = a.stats()
    assert stats["cma"]["entries"] == 0 and stats["shm"]["entries"] == 0  # same host, yet only TCP reaches it
    assert stats["tcp"]["entries"] >= 3
    assert b.stats()["tcp"]["server_staged_bytes"] == 4096 + 5000  # every byte through the device copies


def test_own_device_buffers_are_staged_through_host_memory_in_chunks(device_pair, monkeypatch):
    a, b, abuf, bdev = device_pair
    monkeypatch.setattr(te_device, "CHUNK", 10000)  # a 24,000-byte batch moves in three staged pieces
    a_name = f"127.0.0.1:{a.get_rpc_port()}"
    abuf[:] = np.arange(abuf.size, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    want = abuf[:24000].copy()
    assert b.transfer_sync_read(a_name, bdev.ctypes.data, abuf.ctypes.data, 24000) == 0
    assert np.array_equal(bdev[:24000], want)
    bdev[30000:31000] = 3
    assert b.batch_transfer_sync_write(a_name, [bdev.ctypes.data + 30000], [abuf.ctypes.data + 40000], [1000]) == 0
    assert (abuf[40000:41000] == 3).all()
    bid = b.batch_transfer_async_write(a_name, [bdev.ctypes.data + 30000], [abuf.ctypes.data + 50000], [1000])
    assert bid > 0 and b.get_batch_transfer_status([bid]) == 0 and (abuf[50000:51000] == 3).all()
    assert b.stats()["device_staged_bytes"] == 26000
    # a span running past the device buffer's end is refused before anything moves
    abuf[:] = 0
    assert b.transfer_sync_write(a_name, bdev.ctypes.data + bdev.size - 10, abuf.ctypes.data, 20) == -1
    assert not abuf.any()


def test_a_cuda_location_without_a_cuda_runtime_is_refused_by_code(monkeypatch):
    monkeypatch.delenv("KVPLUGINS_TRANSFER_DEVICE_EMULATION", raising=False)
    e = te.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.zeros(4096, np.uint8)
    try:
        assert e.register_memory(buf.ctypes.data, buf.nbytes, "cuda:0") == -1  # no libcudart loaded here
        assert e.register_memory(buf.ctypes.data, buf.nbytes, "tpu:0") == -1
        assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0  # "*": a host pointer is host memory
    finally:
        e.close()
