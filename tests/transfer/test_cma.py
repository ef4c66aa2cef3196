"""The cma transport against real peer processes: it reaches a same-host peer's ordinary memory (no shm file),
before tcp; a pid that no longer names the peer moves no byte; a kernel refusal (a non-dumpable peer, a reader
without CAP_SYS_PTRACE: a real EPERM) falls back to tcp, counted, and is not tried again. The byte-exact
contract over cma runs in test_contract.py / test_span_batches.py (parametrized over every transport)."""

import dataclasses
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from helpers.peer import PLAIN_SIZE, Peer, digest
from kvplugins.errors import TransferFailed
from kvplugins.transfer import TransferConfig, TransferEngine
from kvplugins.transfer.peers import start_time


@pytest.fixture
def engine():
    eng = TransferEngine(TransferConfig(transports="shm,cma,tcp", timeout_ms=10000))
    yield eng
    eng.close()


def test_plain_memory_of_a_same_host_peer_goes_over_cma(engine):
    src = np.frombuffer(np.random.default_rng(5).bytes(PLAIN_SIZE), dtype=np.uint8)
    dst = np.zeros(PLAIN_SIZE, dtype=np.uint8)
    engine.register(src)
    engine.register(dst)
    with Peer(transports="shm,cma,tcp") as peer:
        assert peer.descriptor.region(peer.plain_id).addr is not None
        n = PLAIN_SIZE // 2
        offs = np.arange(0, n, 4096, dtype=np.uint64)
        lens = np.full(len(offs), 4096, dtype=np.uint64)
        assert engine.write_spans(peer.descriptor, peer.plain_id, offs + src.ctypes.data, offs, lens) == [None] * len(
            offs
        )
        assert peer.digest(0, n, region=peer.plain_id) == digest(src[:n])
        assert engine.read_spans(peer.descriptor, peer.plain_id, offs + dst.ctypes.data + n, offs, lens) == [
            None
        ] * len(offs)
    assert bytes(dst[n:]) == bytes(src[:n])
    stats = engine.stats()
    assert stats["cma"]["bytes"] == 2 * n and stats["tcp"]["entries"] == 0 and stats["fallbacks"] == {}


def test_a_pid_that_names_another_process_moves_no_byte():
    eng = TransferEngine(TransferConfig(transports="cma", timeout_ms=5000))
    dst = np.full(8192, 7, dtype=np.uint8)
    eng.register(dst)
    try:
        with Peer(transports="cma") as peer:
            ep = peer.descriptor.transports["cma"]
            assert ep["start"] == start_time(peer.proc.pid)
            reused = dataclasses.replace(peer.descriptor, transports={"cma": {**ep, "start": ep["start"] + 1}})
            st = eng.read_spans(reused, peer.plain_id, [dst.ctypes.data], [0], [8192])
    finally:
        eng.close()
    assert isinstance(st[0], TransferFailed) and "has exited" in str(st[0])
    assert (dst == 7).all()


_READER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from kvplugins.transfer import SegmentDescriptor, TransferConfig, TransferEngine
    desc, region = SegmentDescriptor.from_wire(json.loads(sys.argv[1])), int(sys.argv[2])
    with TransferEngine(TransferConfig(transports="cma,tcp")) as eng:
        dst = np.zeros(3 * 4096, dtype=np.uint8)
        eng.register(dst)
        st = [eng.read_spans(desc, region, [dst.ctypes.data + i * 4096], [i * 4096], [4096]) for i in range(3)]
        print(json.dumps({"ok": [s == [None] for s in st], "stats": eng.stats(), "sum": int(dst.sum())}))
""")


def test_a_kernel_refusal_falls_back_to_tcp_once():
    """A real EPERM: the peer is non-dumpable and the reader runs without CAP_SYS_PTRACE (setpriv)."""
    with Peer(transports="cma,tcp", dumpable=False) as peer:
        peer_sum = int(np.frombuffer(peer.read(0, 3 * 4096), dtype=np.uint8).sum())  # seeded random bytes
        out = subprocess.run(
            [
                "setpriv",
                "--inh-caps=-sys_ptrace",
                "--bounding-set=-sys_ptrace",
                sys.executable,
                "-c",
                _READER,
                json.dumps(peer.descriptor.to_wire()),
                str(peer.region_id),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    got = json.loads(out.stdout)
    assert got["ok"] == [True] * 3 and got["sum"] == peer_sum > 0
    assert got["stats"]["fallbacks"] == {"cma->tcp": 1} and got["stats"]["tcp"]["entries"] == 3
    assert got["stats"]["cma"]["denied_peers"] == 1
    assert "refuses access" in out.stderr and "Operation not permitted" in out.stderr
