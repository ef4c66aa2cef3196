"""The RDMA transport's verbs layer over rdma-core's pyverbs (Debian 12's python3-pyverbs, rdma-core 44).

``Nic``: one opened device port (context, protection domain, memory regions); ``QueuePair``: one RC queue pair
with its own completion queue; ``run(work, deadline)``: posts chains of one-sided RDMA READ/WRITE work requests
on several queue pairs at once and polls their completions, from the calling thread.

Polling: pyverbs' ``CompChannel.get_cq_event`` blocks in C while holding the GIL (pyverbs/cq.pyx), so a
completion channel would stall every other Python thread; ``run`` polls the CQs instead, yielding the GIL
between polls (``time.sleep(0)``, then sleeps growing to 0.5 ms), so no other thread waits on it.
Selective signalling: one work request in ``signal_every`` asks for a completion (and the last one); a
successful signalled completion confirms every earlier request on that QP (RC completes in order). An error
completion, a failed post or the deadline marks the QP dead: moved to the error state, its unconfirmed work
returned as failed for the caller to retry elsewhere.
Sources: ibv_post_send(3), ibv_poll_cq(3), ibv_modify_qp(3) (RC INIT -> RTR -> RTS attributes as in
rdma-core's libibverbs/examples/rc_pingpong.c), pyverbs qp.pyx / wr.pyx / cq.pyx.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvplugins.transfer.nics import MTU_BYTES

MTU_ENUM = {b: e for e, b in MTU_BYTES.items()}  # bytes -> enum ibv_mtu
_QP_TIMEOUT, _RETRY, _RNR_RETRY, _RD_ATOMIC = 14, 7, 7, 16  # 4.096 us * 2^14 = 67 ms per try, 7 tries


def import_pyverbs() -> tuple[Any, str | None]:
    """(the pyverbs.enums module, None), or (None, why it cannot be imported)."""
    try:
        import pyverbs.enums as e
        import pyverbs.qp  # noqa: F401  - the modules run() needs, imported once here

        return e, None
    except ImportError as ex:
        return None, f"pyverbs is not importable ({ex})"


@dataclass(frozen=True)
class Chunk:
    """One work request: ``length`` bytes (<= 1 GiB) between local (addr, lkey) and remote (addr, rkey)."""

    laddr: int
    lkey: int
    raddr: int
    rkey: int
    length: int


class Nic:
    """One opened RDMA device port: context, protection domain and an MR per registered region.

    ``info``: the kvplugins.transfer.nics.Nic it was opened from. Thread-safe. Raises PyverbsError
    (an OSError subclass for the errno forms) when the device cannot be opened."""

    def __init__(self, info):
        import pyverbs.device as d
        from pyverbs.pd import PD

        self.info = info
        self.ctx = d.Context(name=info.name)
        self.pd = PD(self.ctx)
        self._lock = threading.Lock()
        self._mrs: dict[tuple[int, int, int], list] = {}  # (addr, length, access) -> [MR, refs]

    def register(self, addr: int, length: int, access: int):
        """The MR of [addr, addr+length) with ``access`` (ibv_access_flags), registered once and shared by
        later identical registrations (refcounted). Raises PyverbsRDMAError (e.g. ENOMEM over RLIMIT_MEMLOCK)."""
        from pyverbs.mr import MR

        key = (addr, length, access)
        with self._lock:
            hit = self._mrs.get(key)
            if hit is None:
                hit = self._mrs[key] = [MR(self.pd, length, access, address=addr), 0]
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
        """Whether the port is ACTIVE now (one query_port verb)."""
        import pyverbs.enums as e

        try:
            return self.ctx.query_port(self.info.port).state == e.IBV_PORT_ACTIVE
        except Exception:  # noqa: BLE001 - a device gone away reads as down
            return False

    def close(self) -> None:
        with self._lock:
            mrs, self._mrs = [m for m, _ in self._mrs.values()], {}
        for mr in mrs:
            mr.close()
        self.pd.close()
        self.ctx.close()


class QueuePair:
    """One RC queue pair on ``nic`` with its own CQ; created in INIT, connected by ``connect``.
    Used by one batch at a time (the transport's pool checks it out)."""

    def __init__(self, nic: Nic, depth: int):
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self.nic, self.depth = nic, depth
        self.cq = CQ(nic.ctx, depth + 1, None, None, 0)
        cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        attr = QPAttr()
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        attr.port_num = nic.info.port
        self.qp = QP(nic.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap), attr)
        self.qpn = self.qp.qp_num
        self.psn = secrets.randbelow(1 << 24)
        self.dead = False

    def local(self) -> dict[str, Any]:
        """What the peer's QP needs to connect to this one: qpn, psn, gid, lid, mtu (bytes)."""
        n = self.nic.info
        return {"qpn": self.qpn, "psn": self.psn, "gid": n.gid, "lid": n.lid, "mtu": n.active_mtu}

    def connect(self, remote: dict[str, Any]) -> None:
        """INIT -> RTR -> RTS towards the remote QP described by ``remote`` (as local() gives). The path MTU is
        the smaller of the two ports'. Raises PyverbsRDMAError where the device refuses the attributes."""
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        n = self.nic.info
        attr = QPAttr(qp_state=e.IBV_QPS_RTR)
        attr.path_mtu = MTU_ENUM[min(n.active_mtu, int(remote["mtu"]))]
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = int(remote["qpn"]), int(remote["psn"]), self.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = _RD_ATOMIC
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, _QP_TIMEOUT, _RETRY, _RNR_RETRY
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        if n.link_layer == "InfiniBand" and not remote["gid"]:
            attr.ah_attr = AHAttr(dlid=int(remote["lid"]), port_num=n.port)
        else:
            gr = GlobalRoute(dgid=GID(str(remote["gid"])), sgid_index=n.gid_index, hop_limit=64)
            attr.ah_attr = AHAttr(gr=gr, is_global=1, dlid=int(remote["lid"]), port_num=n.port)
        self.qp.to_rts(attr)

    def kill(self) -> None:
        """Move the QP to the error state (outstanding work is flushed, the NIC stops touching its memory)."""
        import pyverbs.enums as e
        from pyverbs.qp import QPAttr

        self.dead = True
        try:
            self.qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
        except Exception:  # noqa: BLE001 - a QP already in error, or a device gone away
            pass

    def close(self) -> None:
        for obj in (self.qp, self.cq):
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - closing after a device error must not raise
                pass


@dataclass
class Work:
    """The chunks one QP runs in a batch, and how far it got: ``done`` chunks confirmed, ``posted`` posted."""

    qp: QueuePair
    chunks: list[Chunk]
    done: int = 0
    posted: int = 0
    finished_at: float = 0.0
    error: str | None = None
    failed: list[Chunk] = field(default_factory=list)


def run(op_read: bool, works: list[Work], deadline_at: float, signal_every: int) -> int:
    """Post and complete every Work's chunks (RDMA READ if ``op_read`` else WRITE) by ``deadline_at``
    (time.monotonic()). A QP that fails (error completion, post refused, deadline) is killed and its
    unconfirmed chunks land in ``work.failed`` with ``work.error``. Returns the work requests posted."""
    import pyverbs.enums as e

    opcode = e.IBV_WR_RDMA_READ if op_read else e.IBV_WR_RDMA_WRITE
    live, posted, idle = [w for w in works if w.chunks], 0, 0
    while live:
        progress = False
        for w in live:
            posted += _post(w, opcode, signal_every, e)
            progress |= _poll(w, e)
        live = [w for w in live if not w.qp.dead and w.done < len(w.chunks)]
        if progress:
            idle = 0
            continue
        if time.monotonic() > deadline_at:
            for w in live:
                _fail(w, "no completion before the deadline")
            break
        idle += 1
        time.sleep(0 if idle < 64 else min(5e-4, 1e-5 * (idle - 63)))  # yield the GIL, then back off
    return posted


def _post(w: Work, opcode: int, signal_every: int, e) -> int:
    """Post the next chain of w's chunks that fits its send queue; returns how many were posted."""
    from pyverbs.wr import SGE, SendWR

    room = w.qp.depth - (w.posted - w.done)
    end = min(len(w.chunks), w.posted + room)
    if end <= w.posted or w.qp.dead:
        return 0
    head = prev = None
    keep = []  # the SendWR/SGE objects must live until post_send returns
    for k in range(w.posted, end):
        c = w.chunks[k]
        sge = SGE(c.laddr, c.length, c.lkey)
        flags = e.IBV_SEND_SIGNALED if (k + 1) % signal_every == 0 or k == len(w.chunks) - 1 else 0
        wr = SendWR(wr_id=k, opcode=opcode, num_sge=1, sg=[sge], send_flags=flags)
        wr.set_wr_rdma(c.rkey, c.raddr)
        keep.append((wr, sge))
        if prev is None:
            head = wr
        else:
            prev.next_wr = wr
        prev = wr
    try:
        w.qp.qp.post_send(head)
    except Exception as ex:  # noqa: BLE001 - PyverbsRDMAError: QP in error, device gone
        _fail(w, f"post_send refused: {ex}")
        return 0
    n = end - w.posted
    w.posted = end
    return n


def _poll(w: Work, e) -> bool:
    """Take w's completions; True if any arrived."""
    if w.qp.dead or w.done == w.posted:
        return False
    try:
        n, wcs = w.qp.cq.poll(w.qp.depth)
    except Exception as ex:  # noqa: BLE001
        _fail(w, f"poll_cq failed: {ex}")
        return True
    for wc in wcs:
        if wc.status != e.IBV_WC_SUCCESS:
            _fail(w, f"work completion status {wc.status} ({_WC_NAMES.get(wc.status, 'error')})")
            return True
        w.done = max(w.done, wc.wr_id + 1)
    if w.done == len(w.chunks):
        w.finished_at = time.monotonic()
    return n > 0


def _fail(w: Work, why: str) -> None:
    w.error = w.error or why
    w.failed = w.chunks[w.done :]
    w.qp.kill()


_WC_NAMES = {
    1: "local length error",
    2: "local QP operation error",
    4: "local protection error",
    5: "flushed",
    9: "remote invalid request",
    10: "remote access error",
    11: "remote operation error",
    12: "transport retry counter exceeded",
    13: "RNR retry counter exceeded",
}
