"""A real peer process for transfer tests: it runs its own TransferEngine, exports regions filled with
seeded random bytes, sends its SegmentDescriptor back, and answers digest/read/fill commands over a pipe.

    with Peer(transports="tcp", size=1 << 20, seed=7) as p:
        p.descriptor, p.region_id (alloc_shared, exported), p.plain_id (plain numpy, exported),
        p.hidden_id (registered, not exported), p.guarded_id (plain numpy, exported read-only to peers: GUARDED
        bytes seeded from ``seed + 1``), p.digest(off, n), p.read(off, n), p.stats(), p.kill(), p.stop()
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import signal
import time

import numpy as np

from kvplugins.transfer import SegmentDescriptor, TransferConfig, TransferEngine

PLAIN_SIZE = 1 << 20
GUARDED_SIZE = 1 << 16
START_S = 180 if os.environ.get("KVPLUGINS_IN_GUEST") == "1" else 30  # the TCG guest is ~10-50x slower


def seeded(size: int, seed: int) -> np.ndarray:
    """The bytes a peer's shared region starts with: ``size`` uint8 from ``seed``."""
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)


def _main(conn, config_kwargs: dict, size: int, seed: int, dumpable: bool = True) -> None:
    if not dumpable:  # prctl(PR_SET_DUMPABLE, 0): only CAP_SYS_PTRACE may now read its memory (cma)
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    eng = TransferEngine(TransferConfig(**config_kwargs))
    shared = eng.alloc_shared(size)
    eng.memoryview(shared)[:] = seeded(size, seed)
    plain = np.zeros(PLAIN_SIZE, dtype=np.uint8)
    plain_r = eng.register(plain, export=True)
    hidden_r = eng.register(np.zeros(4096, dtype=np.uint8), export=False)
    guarded = seeded(GUARDED_SIZE, seed + 1).copy()
    guarded_r = eng.register(guarded, export=True, peer_readonly=True)
    ids = (shared.region_id, plain_r.region_id, hidden_r.region_id, guarded_r.region_id)
    conn.send((eng.descriptor().to_wire(), *ids))
    regions = {shared.region_id: shared, plain_r.region_id: plain_r, guarded_r.region_id: guarded_r}
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "stats":
            conn.send(eng.stats())
            continue
        if cmd == "spin":  # hold the GIL in the main thread for args[0] seconds
            _spin(args[0])
            conn.send("spun")
            continue
        view = eng.memoryview(regions[args[0]])[args[1] : args[1] + args[2]]
        if cmd == "digest":
            conn.send(hashlib.blake2b(view).hexdigest())
        elif cmd == "read":
            conn.send(bytes(view))
    eng.close()


def _spin(seconds: float) -> None:
    """Busy-loop in Python holding the GIL: the switch interval is raised past the spin, so no other Python
    thread of this process runs until it ends (native threads keep running)."""
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 30)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(before)


class Peer:
    """A spawned peer process (see module doc). Kill/stop it to test failures; always use as a context."""

    def __init__(
        self, transports: str = "shm,tcp", size: int = 1 << 20, seed: int = 0, dumpable: bool = True, **config
    ):
        """``dumpable=False``: the peer makes itself non-dumpable, so a process without CAP_SYS_PTRACE cannot
        reach its memory with process_vm_readv (the cma transport's EPERM)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_main, args=(child, {"transports": transports, **config}, size, seed, dumpable), daemon=True
        )
        self.proc.start()
        child.close()
        if not self._conn.poll(START_S):
            self.kill()
            raise RuntimeError(f"peer process did not start within {START_S} s")
        wire, self.region_id, self.plain_id, self.hidden_id, self.guarded_id = self._conn.recv()
        self.descriptor = SegmentDescriptor.from_wire(wire)
        self.size, self.seed = size, seed

    def digest(self, offset: int, length: int, region: int | None = None) -> str:
        """blake2b hex digest of the peer's bytes [offset, offset+length) of ``region`` (default shared)."""
        self._conn.send(("digest", region or self.region_id, offset, length))
        return self._conn.recv()

    def read(self, offset: int, length: int, region: int | None = None) -> bytes:
        self._conn.send(("read", region or self.region_id, offset, length))
        return self._conn.recv()

    def stats(self) -> dict:
        """The peer engine's TransferEngine.stats()."""
        self._conn.send(("stats",))
        return self._conn.recv()

    def spin(self, seconds: float) -> None:
        """Make the peer's main thread hold its GIL for ``seconds``; ``wait_spun()`` waits for the end."""
        self._conn.send(("spin", seconds))

    def wait_spun(self, timeout: float) -> bool:
        """True once the spin started by ``spin()`` has ended (within ``timeout`` seconds)."""
        return self._conn.poll(timeout) and self._conn.recv() == "spun"

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        """SIGSTOP: the process stays alive but answers nothing (a hung peer). Returns once it is stopped
        (signal delivery is asynchronous)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while _state(self.proc.pid) not in ("T", "t"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer {self.proc.pid} did not stop")
            time.sleep(0.001)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self._conn.send(("exit",))
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(5)
        self.kill()
        self._conn.close()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write_main(conn, wire: dict, region_id: int, size: int, byte: int, timeout_ms: float) -> None:
    eng = TransferEngine(TransferConfig(transports="tcp", tcp_connections=1))
    src = np.full(size, byte, dtype=np.uint8)
    local = eng.register(src)
    desc = SegmentDescriptor.from_wire(wire)
    eng.read_spans(desc, region_id, [local.addr], [0], [1])  # the one connection, authenticated and pooled
    src[0] = byte
    conn.send("ready")
    conn.recv()  # go
    [err] = eng.write_spans(desc, region_id, [local.addr], [0], [size], timeout_ms)
    conn.send(repr(err))
    eng.close()


class Writer:
    """A spawned process writing ``size`` bytes of ``byte`` to offset 0 of ``peer``'s shared region over TCP in
    one batch with ``timeout_ms`` once told to (``go()``), over one connection it opened before; ``pid`` to pause
    it, ``result(timeout)`` the repr of its status ("None": written)."""

    def __init__(self, peer: Peer, size: int, byte: int, timeout_ms: float):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        args = (child, peer.descriptor.to_wire(), peer.region_id, size, byte, timeout_ms)
        self.proc = ctx.Process(target=_write_main, args=args, daemon=True)
        self.proc.start()
        child.close()
        if not (self._conn.poll(START_S) and self._conn.recv() == "ready"):
            self.proc.kill()
            raise RuntimeError(f"writer process did not start within {START_S} s")
        self.pid = self.proc.pid

    def go(self) -> None:
        self._conn.send("go")

    def result(self, timeout: float) -> str | None:
        return self._conn.recv() if self._conn.poll(timeout) else None

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.join(5)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def digest(data) -> str:
    """The digest Peer.digest computes, for local bytes."""
    return hashlib.blake2b(memoryview(data).cast("B")).hexdigest()
