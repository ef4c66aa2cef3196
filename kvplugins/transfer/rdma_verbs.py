"""The RDMA transport's verbs layer: a small wrapper over the native ``kvplugins._verbs`` (native/src/verbs),
which loads libibverbs (rdma-core) at run time, so this imports on any host.

``Nic``: one opened device port (context, protection domain, one completion channel, memory regions);
``QueuePair``: one RC queue pair with its own completion queue; ``run(works, deadline)``: posts chains of one-sided
RDMA READ/WRITE work requests on several queue pairs at once and completes them, in one native call with the GIL
released: it polls the CQs while completions come, spins after the last one (twice the process's recent
completion gap, 100 us .. 2 ms), then sleeps on the devices' completion channels (a batch waiting on a slow peer
burns no core). ``fast_routes``: the native table of small-batch routes (rdma_fast.py).
Selective signalling: one work request in ``signal_every`` asks for a completion (and the last one, and the one
that fills a send queue); a successful signalled completion confirms every earlier request on that QP (RC
completes in order). An error completion, a refused post or the deadline marks the QP dead: moved to the error
state, its unconfirmed work returned as failed for the caller to retry elsewhere.
Native failures (``_verbs.VerbsError``) become TransferFailed here and nowhere else.
Sources: ibv_post_send(3), ibv_poll_cq(3), ibv_modify_qp(3), ibv_get_cq_event(3) (RC INIT -> RTR -> RTS
attributes as in rdma-core's libibverbs/examples/rc_pingpong.c).
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from kvplugins.errors import TransferFailed
from kvplugins.transfer.nics import MTU_BYTES

MTU_ENUM = {b: e for e, b in MTU_BYTES.items()}  # bytes -> enum ibv_mtu
ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, ACCESS_REMOTE_READ = 1, 2, 4  # enum ibv_access_flags
PORT_ACTIVE = 4  # enum ibv_port_state


def load_error() -> str | None:
    """None when the verbs layer can be used here, else why not and the fix (the module is not built, or
    libibverbs cannot be loaded)."""
    try:
        from kvplugins import _verbs
    except ImportError as e:
        return f"kvplugins was built without RDMA verbs ({e}): apt-get install libibverbs-dev, then bash ci/install.sh"
    return _verbs.load_error() or None


def _mod():
    from kvplugins import _verbs

    return _verbs


@contextlib.contextmanager
def _native(what: str) -> Iterator[None]:
    """VerbsError (and the module's ValueError for bad arguments) as TransferFailed naming ``what``."""
    try:
        yield
    except _mod().VerbsError as e:
        raise TransferFailed(f"{what}: {e}") from None


def query_ports(name: str, ports: list[int]) -> list[tuple[int, int, int, int]]:
    """(state, active_mtu, lid, link_layer) of each of device ``name``'s ``ports`` as ibv_query_port gives
    them (enums ibv_port_state, ibv_mtu, IBV_LINK_LAYER_*). Raises TransferFailed when the device cannot be
    opened or queried (no uverbs node, permissions), naming it."""
    with _native(f"RDMA device {name}"):
        ctx = _mod().Context(name)
        return [ctx.query_port(p) for p in ports]


class Nic:
    """One opened RDMA device port: context, protection domain and an MR per registered region.

    ``info``: the kvplugins.transfer.nics.Nic it was opened from. Thread-safe. Raises TransferFailed when the
    device cannot be opened."""

    def __init__(self, info):
        self.info = info
        with _native(f"opening RDMA device {info.name}"):
            self.ctx = _mod().Context(info.name)
        self._lock = threading.Lock()
        self._mrs: dict[tuple[int, int, int], list] = {}  # (addr, length, access) -> [MR, refs]

    def register(self, addr: int, length: int, access: int):
        """The MR (``lkey``, ``rkey``) of [addr, addr+length) with ``access`` (ACCESS_* flags), registered once
        and shared by later identical registrations (refcounted). Raises TransferFailed (e.g. ENOMEM over
        RLIMIT_MEMLOCK)."""
        key = (addr, length, access)
        with self._lock:
            hit = self._mrs.get(key)
            if hit is None:
                if self.ctx is None:
                    raise TransferFailed(f"RDMA device {self.info.name} is closed")
                with _native(f"registering {length} bytes at {addr:#x} on {self.info.name}"):
                    hit = self._mrs[key] = [_mod().MemoryRegion(self.ctx, addr, length, access), 0]
            hit[1] += 1
            return hit[0]

    def deregister(self, addr: int, length: int, access: int) -> None:
        with self._lock:
            hit = self._mrs.get((addr, length, access))
            if hit is None:
                return
            hit[1] -= 1
            if hit[1] == 0:
                del self._mrs[(addr, length, access)]
                hit[0].close()

    def port_active(self) -> bool:
        """Whether the port is ACTIVE now (one query_port verb); False once closed or for a device gone."""
        ctx = self.ctx
        try:
            return ctx is not None and ctx.query_port(self.info.port)[0] == PORT_ACTIVE
        except _mod().VerbsError:
            return False

    def close(self) -> None:
        """Deregister every MR and drop the device; it closes once its last queue pair is closed too."""
        with self._lock:
            mrs, self._mrs = [m for m, _ in self._mrs.values()], {}
            self.ctx = None
        for mr in mrs:
            mr.close()


class QueuePair:
    """One RC queue pair on ``nic`` with its own CQ; created in INIT, connected by ``connect``.
    Used by one batch at a time (the transport's pool checks it out). Raises TransferFailed."""

    def __init__(self, nic: Nic, depth: int):
        self.nic, self.depth = nic, depth
        if nic.ctx is None:
            raise TransferFailed(f"RDMA device {nic.info.name} is closed")
        with _native(f"creating a queue pair on {nic.info.name}"):
            self.qp = _mod().QueuePair(nic.ctx, depth, nic.info.port)
        self.qpn = self.qp.qpn
        self.psn = secrets.randbelow(1 << 24)

    @property
    def dead(self) -> bool:
        """Killed (error state) or closed: never used again."""
        return bool(self.qp.dead)

    def local(self) -> dict[str, Any]:
        """What the peer's QP needs to connect to this one: qpn, psn, gid, lid, mtu (bytes)."""
        n = self.nic.info
        return {"qpn": self.qpn, "psn": self.psn, "gid": n.gid, "lid": n.lid, "mtu": n.active_mtu}

    def connect(self, remote: dict[str, Any]) -> None:
        """INIT -> RTR -> RTS towards the remote QP described by ``remote`` (as local() gives). The path MTU is
        the smaller of the two ports'. Raises TransferFailed where the device refuses the attributes, ValueError
        for a malformed GID."""
        n = self.nic.info
        lid_route = n.link_layer == "InfiniBand" and not remote["gid"]
        dgid = b"" if lid_route else ipaddress.IPv6Address(str(remote["gid"])).packed
        with _native(f"connecting QP {self.qpn} to QP {remote['qpn']}"):
            self.qp.connect(
                MTU_ENUM[min(n.active_mtu, int(remote["mtu"]))],
                int(remote["qpn"]),
                int(remote["psn"]),
                self.psn,
                dgid,
                int(remote["lid"]),
                n.gid_index,
                n.port,
            )

    def kill(self) -> None:
        """Move the QP to the error state (outstanding work is flushed, the NIC stops touching its memory)."""
        self.qp.kill()

    def close(self) -> None:
        """Destroy the QP, its CQ and channel (after a batch still running on it ends). Idempotent."""
        self.qp.close()


@dataclass(frozen=True)
class QpRun:
    """How far one queue pair got in a run_spans call: ``done`` work requests confirmed (``nbytes`` bytes),
    ``posted`` posted, when it finished (time.monotonic()), and ``error`` ("" if none: then every request is done)."""

    done: int
    posted: int
    finished_at: float
    error: str
    nbytes: int


def run_spans(
    op_read: bool,
    qps: list[QueuePair],
    laddr,
    lkey,
    raddr,
    rkey,
    length,
    limit: int,
    deadline_at: float,
    signal_every: int,
) -> tuple[int, list[QpRun], list[int]]:
    """Move span j: ``length[j]`` bytes between local (``laddr[j]``, lkey) and remote (``raddr[j]``, rkey) by RDMA
    READ (``op_read``) or WRITE, cut into work requests of at most ``limit`` bytes dealt round robin over ``qps``,
    all posted and completed by ``deadline_at`` (time.monotonic()) in one native call with the GIL released. The
    columns are uint64 arrays, or int lists (a small batch: no numpy call); ``lkey``/``rkey`` hold one per span or
    one for all. A QP that fails (error completion, post refused, deadline) is killed. Returns (work requests
    posted, a QpRun per QP, the spans not confirmed). Raises ValueError for mismatched columns, keys over 32 bits,
    a limit outside 1 .. 1 GiB, or a QP given twice."""
    posted, out, failed = _mod().run_spans(
        op_read,
        [q.qp for q in qps],
        laddr,
        lkey,
        raddr,
        rkey,
        length,
        int(limit),
        deadline_at,
        max(1, int(signal_every)),
    )
    lost = [] if failed.count(1) == 0 else np.flatnonzero(np.frombuffer(failed, dtype=np.bool_)).tolist()
    return posted, [QpRun(*r) for r in out], lost


def fast_routes(max_bytes: int, max_spans: int, signal_every: int, timeout_ms: float, max_routes: int = 256):
    """The native ``_verbs.FastRoutes`` table (rdma_fast.py; native/src/verbs/fast.h): batches of at most
    ``max_spans`` spans and ``max_bytes`` bytes, ``timeout_ms`` when a call gives none, ``max_routes`` routes."""
    return _mod().FastRoutes(
        int(max_bytes), int(max_spans), max(1, int(signal_every)), float(timeout_ms), max(1, int(max_routes))
    )
