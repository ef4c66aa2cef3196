"""Which NIC pairs ("paths") reach a peer, and how a batch is striped over them.

Pairing (Mooncake's transfer engine pairs NICs by topology, FAST'25 section 4.1; here by subnet): a local NIC
pairs with the peer's NIC on the same IPv4 subnet (RoCE), else with the peer NIC of the same index modulo their
count (InfiniBand, or unknown addresses). A region is served by the local NICs on its NUMA node when there are
any (``numa_of``), else by all. Striping: bytes are shared in proportion to each path's weight, its measured
throughput (an exponential moving average of bytes per second per path, kept as telemetry), seeded from the
link speed. A path that fails is down until ``probe_s`` later; the transport's prober brings it back.
"""

from __future__ import annotations

import ctypes
import ipaddress
import platform
import threading
import time
from dataclasses import dataclass

_EWMA = 0.3  # weight of the newest throughput sample
_MIN_SAMPLE = 256 << 10  # bytes a path must move in a batch for its throughput sample to count


@dataclass(frozen=True)
class Path:
    """Local NIC index ``local`` (into the transport's NIC list) to the peer's NIC index ``remote``."""

    local: int
    remote: int


def pair(local_nets: list[str | None], remote_nets: list[str | None]) -> list[Path]:
    """Paths from local NICs to a peer's NICs (module doc). ``*_nets``: each NIC's "a.b.c.d/prefix" or None."""
    out = []
    for i, net in enumerate(local_nets):
        same = [j for j, r in enumerate(remote_nets) if net and r and _subnet(net) == _subnet(r)]
        if same:
            out.append(Path(i, same[0]))
        elif not net or not any(remote_nets):
            out.append(Path(i, i % len(remote_nets)))
    return out


def _subnet(cidr: str):
    try:
        return ipaddress.ip_interface(cidr).network
    except ValueError:
        return None


class PathStats:
    """Per path: measured throughput (bytes/s, EWMA), bytes and failures; down-until times. Thread-safe."""

    def __init__(self, probe_s: float):
        self._probe_s = probe_s
        self._lock = threading.Lock()
        self._rate: dict[tuple, float] = {}
        self._down: dict[tuple, float] = {}
        self.counts: dict[str, int] = {
            "wrs": 0,
            "fast_batches": 0,
            "path_failures": 0,
            "qp_rebuilds": 0,
            "striped_batches": 0,
        }
        self._bytes: dict[str, int] = {}

    def weight(self, key: tuple, seed: float) -> float:
        with self._lock:
            return self._rate.get(key, seed)

    def sample(self, key: tuple, name: str, nbytes: int, seconds: float) -> None:
        """``nbytes`` moved on path ``key`` (shown as ``name``, "<local NIC>-><peer NIC index>") in ``seconds``."""
        with self._lock:
            self._bytes[name] = self._bytes.get(name, 0) + nbytes
            if nbytes < _MIN_SAMPLE or seconds <= 0:
                return
            old = self._rate.get(key)
            new = nbytes / seconds
            self._rate[key] = new if old is None else (1 - _EWMA) * old + _EWMA * new

    def failed(self, key: tuple) -> None:
        with self._lock:
            self._down[key] = time.monotonic() + self._probe_s
            self.counts["path_failures"] += 1

    def up(self, key: tuple) -> bool:
        with self._lock:
            until = self._down.get(key)
            if until is None:
                return True
            if time.monotonic() >= until:
                del self._down[key]
                return True
            return False

    def restore(self, key: tuple) -> None:
        with self._lock:
            self._down.pop(key, None)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def snapshot(self) -> dict:
        with self._lock:
            out = dict(self.counts)
            out["path_mbps"] = {f"{k[0]}:{k[-2]}->{k[-1]}": round(v / 1e6, 1) for k, v in self._rate.items()}
            out["path_bytes"] = dict(self._bytes)
            out["paths_down"] = len(self._down)
            return out


def stripe(lengths: list[int], weights: list[float]) -> list[int]:
    """Path index for each piece (by ``lengths``, bytes), sharing bytes in proportion to ``weights``: each
    piece goes to the path furthest below its share so far."""
    total_w = sum(weights)
    total = sum(lengths)
    share = [total * w / total_w for w in weights]
    given = [0.0] * len(weights)
    out = []
    for n in lengths:
        k = max(range(len(weights)), key=lambda j: share[j] - given[j])
        given[k] += n
        out.append(k)
    return out


_MPOL_F_NODE, _MPOL_F_ADDR, _SYS_GET_MEMPOLICY = 1, 2, 239  # x86_64 get_mempolicy(2)


def numa_of(addr: int) -> int:
    """The NUMA node of the page at ``addr`` (get_mempolicy(2) MPOL_F_NODE|MPOL_F_ADDR), or -1 when unknown
    (not x86_64 Linux, a page not yet touched, a kernel without NUMA)."""
    if platform.machine() != "x86_64":
        return -1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        node = ctypes.c_int(-1)
        rc = libc.syscall(
            _SYS_GET_MEMPOLICY,
            ctypes.byref(node),
            None,
            ctypes.c_ulong(0),
            ctypes.c_void_p(addr),
            ctypes.c_ulong(_MPOL_F_NODE | _MPOL_F_ADDR),
        )
        return node.value if rc == 0 else -1
    except (OSError, AttributeError):
        return -1
