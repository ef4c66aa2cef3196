"""One Transfer Engine script, run on kvplugins' ``mooncake.engine`` (kvplugins.mooncake.te) or on the REAL
Mooncake 0.3.13 wheel's, so the return codes and bytes it records can be compared (test_mooncake_te.py).

    python tests/mooncake/te_script.py ours            # prints one JSON line of results
    unshare -n python tests/mooncake/te_script.py real  # the wheel binds 0.0.0.0: a private namespace

The driver starts a peer process of the same implementation (``peer`` mode): it registers 1 MiB of a known
pattern and answers commands on stdin (``dump``: a slice of its buffer in hex, ``notifies``, ``exit``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

MIB = 1 << 20


def engine_module(impl: str):
    if impl == "real":
        from mooncake import engine  # the installed Mooncake wheel
    else:
        from kvplugins.mooncake import te as engine
    return engine


def pattern(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * 7 % 251).astype(np.uint8)


def peer(impl: str) -> None:
    eng = engine_module(impl)
    e = eng.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = pattern(MIB)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    print(json.dumps({"port": e.get_rpc_port(), "addr": buf.ctypes.data}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "dump":
            off, n = int(cmd[1]), int(cmd[2])
            print(json.dumps(buf[off : off + n].tobytes().hex()), flush=True)
        elif cmd[0] == "notifies":
            print(json.dumps([[x.name, x.msg] for x in e.get_notifies()]), flush=True)
        else:
            break


def script(impl: str) -> dict:
    eng = engine_module(impl)
    child = subprocess.Popen(
        [sys.executable, __file__, "peer", impl], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        return _drive(eng, child)
    finally:
        child.stdin.write("exit\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        child.wait(timeout=30)


def _ask(child, cmd: str):
    child.stdin.write(cmd + "\n")
    child.stdin.flush()
    return json.loads(child.stdout.readline())


def _drive(eng, child) -> dict:
    info = json.loads(child.stdout.readline())
    name, raddr, want = f"127.0.0.1:{info['port']}", info["addr"], pattern(MIB)
    e, out = eng.TransferEngine(), {}
    out["init"] = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    local = np.zeros(MIB, dtype=np.uint8)
    la = local.ctypes.data
    out["register"] = e.register_memory(la, local.nbytes)
    out["read"] = e.transfer_sync_read(name, la, raddr, 4096)
    out["read_bytes"] = bool(np.array_equal(local[:4096], want[:4096]))
    local[8192 : 8192 + 8192] = 0x5A
    out["write"] = e.transfer_sync_write(name, la + 8192, raddr + 65536, 8192)
    out["write_bytes"] = _ask(child, f"dump {65536} 8192") == (bytes([0x5A]) * 8192).hex()
    out["batch_read"] = e.batch_transfer_sync_read(
        name, [la + 20000, la + 30000], [raddr + 4096, raddr + 100000], [4096, 1000]
    )
    out["batch_read_bytes"] = bool(
        np.array_equal(local[20000:24096], want[4096:8192]) and np.array_equal(local[30000:31000], want[100000:101000])
    )
    local[40000:41000] = 0x33
    out["batch_write"] = e.batch_transfer_sync_write(name, [la + 40000], [raddr + 300000], [1000])
    out["batch_write_bytes"] = _ask(child, "dump 300000 1000") == (bytes([0x33]) * 1000).hex()
    many = [80000 + 5000 * j for j in range(16)]  # more buffers than a small batch: the core's array form
    out["batch16_read"] = e.batch_transfer_sync_read(name, [la + o for o in many], [raddr + 240000 + 2 * o for o in many],
                                                     [1000 + j for j in range(16)])  # fmt: skip
    out["batch16_read_bytes"] = all(
        np.array_equal(local[o : o + 1000 + j], want[240000 + 2 * o : 240000 + 2 * o + 1000 + j])
        for j, o in enumerate(many)
    )
    for j, o in enumerate(many):
        local[o : o + 500] = j + 1
    out["batch16_write"] = e.batch_transfer_sync_write(name, [la + o for o in many], [raddr + 800000 + 500 * j
                                                       for j in range(16)], [500] * 16)  # fmt: skip
    out["batch16_write_bytes"] = (
        _ask(child, "dump 800000 8000") == b"".join(bytes([j + 1]) * 500 for j in range(16)).hex()
    )
    bid = e.batch_transfer_async_read(name, [la + 50000], [raddr + 500000], [2048])
    out["async_id"] = bid != 0
    out["async_status"] = e.get_batch_transfer_status([bid])
    out["async_bytes"] = bool(np.array_equal(local[50000:52048], want[500000:502048]))
    bid = e.batch_transfer_async(name, [la + 60000], [raddr + 600000], [512], eng.TransferOpcode.Read)
    out["async_opcode_status"] = e.get_batch_transfer_status([bid])
    local[70000:70100] = 0x77
    wid = e.transfer_submit_write(name, la + 70000, raddr + 700000, 100)
    out["submit_id"] = wid not in (0, -1)
    status, deadline = 0, time.monotonic() + 30
    while status == 0 and time.monotonic() < deadline:
        status = e.transfer_check_status(wid)
    out["check_status"] = status
    out["submit_bytes"] = _ask(child, "dump 700000 100") == (bytes([0x77]) * 100).hex()
    out["first_buffer"] = e.get_first_buffer_address(name) == raddr
    out["notify"] = e.transfer_sync(
        name, la, raddr, 16, eng.TransferOpcode.Read, eng.TransferNotify("driver", "done-1")
    )
    out["notifies"] = _ask(child, "notifies")
    out["sizes_differ"] = e.batch_transfer_sync_read(name, [la, la + 16], [raddr], [16, 16])
    out["unknown_peer"] = e.transfer_sync_read(f"127.0.0.1:{_free_port()}", la, raddr, 16)
    managed = e.allocate_managed_buffer(4096)
    out["managed"] = managed != 0
    out["write_bytes_to_buffer"] = e.write_bytes_to_buffer(managed, b"hello", 5)
    out["read_bytes_from_buffer"] = e.read_bytes_from_buffer(managed, 5) == b"hello"
    out["free_managed"] = e.free_managed_buffer(managed, 4096)
    out["unregister"] = e.unregister_memory(la)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if sys.argv[1] == "peer":
        peer(sys.argv[2])
    else:
        if sys.argv[1] == "real":
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        print(json.dumps(script(sys.argv[1])), flush=True)
