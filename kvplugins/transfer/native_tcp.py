"""Small Pythonic wrapper over the raw nanobind module ``kvplugins._tcp`` (native/src/tcp/): the TCP
transport's frame loops. Native failures become kvplugins exceptions here and nowhere else; every blocking
native call releases the GIL.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kvplugins.errors import NativeError, ProtocolError, TransferFailed
from kvplugins.security.limits import ConnLimits
from kvplugins.transfer.api import Region

CLOSED, PROTOCOL, SLOW, IDLE, ERROR = range(5)  # why the native server closed a connection
OK, SERVER, FAILED, RETRY, AUTH, TIMEOUT = range(6)  # per-span outcome of a client batch (native/src/tcp/client.h)


def _mod():
    try:
        from kvplugins import _tcp
    except ImportError as e:  # pragma: no cover - a broken install
        raise NativeError(f"kvplugins native TCP module is not built ({e}); reinstall with `pip install .`") from e
    return _tcp


class Server:
    """Native serving threads (epoll loops). ``control(conn id, header bytes, payload length) -> response frame
    bytes`` answers a control request on a worker thread holding the GIL; raising closes that connection with
    the exception's text as the logged reason."""

    def __init__(self, max_frame: int, limits: ConnLimits, threads: int, control: Callable[[int, bytes, int], bytes]):
        self._srv = _mod().Server(
            int(max_frame), float(limits.frame_timeout_s), float(limits.idle_timeout_s), int(threads), control
        )

    def add_region(self, region: Region, pin: Any) -> None:
        """Serve exported ``region``; ``pin`` (an object keeping its memory mapped) is held until the region is
        removed and no frame uses it any more."""
        dev = region.device
        fns = (dev.index, dev.set_device_fn, dev.memcpy_fn) if dev is not None else (0, 0, 0)
        self._srv.add_region(region.region_id, region.addr, region.length, not region.peers_write, pin, *fns)

    def remove_region(self, region: Region) -> None:
        """Stop serving ``region`` (frames already using it finish; new ones get an error status)."""
        self._srv.remove_region(region.region_id)

    def adopt(self, fd: int) -> int:
        """Serve the connected, authenticated socket ``fd`` (ownership passes: the native side closes it).
        Returns the connection id events name. Raises TransferFailed once closed."""
        try:
            return self._srv.adopt(fd)
        except RuntimeError as e:
            raise TransferFailed(str(e)) from None

    def wait_events(self, timeout_s: float) -> list[tuple[int, int, str]]:
        """Connections closed since the last call, as (conn id, kind, reason); waits up to ``timeout_s``."""
        return self._srv.wait_events(timeout_s)

    def close(self) -> None:
        """End every connection and join the worker threads. Idempotent."""
        self._srv.close()

    def stats(self) -> tuple[int, int]:
        """(connections closed idle, closed slow) by the workers."""
        return self._srv.stats()

    def staged_bytes(self) -> int:
        """Bytes copied between device regions and host memory serving peers (Region.device)."""
        return self._srv.staged_bytes()


class Client:
    """The client frame loop: one batch to one peer over given connections (module doc of native/src/tcp/client.h)."""

    def __init__(self):
        self._c = _mod().Client()

    def transfer(
        self,
        op: int,
        fds: list[int],
        reused: list[bool],
        addrs,
        regions,
        offs,
        lens,
        limit: int,
        max_frame: int,
        timeout_s: float,
        land_by_ms: int = 0,
    ) -> tuple[bytes, list[tuple[int, str]], list[int]]:
        """Move span j: ``lens[j]`` bytes between local ``addrs[j]`` and (``regions[j]``, ``offs[j]``) of the
        peer (uint64 sequences). ``land_by_ms`` (writes; unix ms, 0 = none): sent as each frame's "dl", past which
        the peer drops the frame's bytes (wire.LATE_WRITE). Returns (per-span outcome codes OK/SERVER/FAILED/RETRY
        as bytes, [(span, text)] for the spans not OK, per-connection broken flags: close those)."""
        arr = [np.ascontiguousarray(a, dtype=np.uint64) for a in (addrs, regions, offs, lens)]
        try:
            return self._c.transfer(
                op, fds, [1 if r else 0 for r in reused], *arr, int(limit), int(max_frame), float(timeout_s), land_by_ms
            )
        except ValueError as e:
            raise NativeError(str(e)) from None


def decode_request(header: bytes, payload_len: int, max_frame: int) -> tuple[str, int, int, list, int]:
    """The native server's decoding of a request header: ("data", op, id, [(region, offset, length)], land_by_ms)
    or ("control", 0, 0, [], 0) (Python decodes those). Raises ProtocolError naming the field (tests, fuzzers)."""
    try:
        return _mod().decode_request(bytes(header), int(payload_len), int(max_frame))
    except ValueError as e:
        raise ProtocolError(str(e)) from None


def loopback_baseline(nbytes: int, rounds: int) -> list[float]:
    """Seconds per round to move ``nbytes`` over one plain loopback TCP connection between two native threads:
    the ceiling the TCP transport is compared with (benchmarks/store_bench.py)."""
    return _mod().loopback_baseline(int(nbytes), int(rounds))
