"""The RDMA transport's queue pairs: a pool per (peer segment, NIC path), their set-up over the TCP server's
authenticated connection (both sides), and the background thread that reads port states and rebuilds dead ones.

Set-up (kvplugins/transfer/rdma.py "Connection set-up"): ``connect`` creates a QP on the local NIC and sends a
control request (kind "rdma": client token, peer NIC index, QP number, PSN, GID, LID, MTU) over a pooled TCP
connection; the peer's ``serve_connect`` creates and connects its QP and answers with its own, which the client
then connects to. A QP is used by one batch at a time (``acquire``/``release``); a dead one is closed on release
and rebuilt by the prober (up to REBUILD_TRIES times, one per rdma_probe_ms).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import OrderedDict
from typing import Any

from kvplugins.errors import TransferFailed
from kvplugins.transfer import rdma_verbs as verbs
from kvplugins.transfer.api import SegmentDescriptor
from kvplugins.transfer.config import TransferConfig
from kvplugins.transfer.rdma_paths import Path, PathStats
from kvplugins.transfer.transport import Deadline

log = logging.getLogger("kvplugins.transfer.rdma")
MAX_SERVED_QPS = 4096  # queue pairs this process keeps for its peers; the oldest is closed past it
MAX_PEERS = 1024  # peers whose queue pairs are pooled; the least recently used is forgotten past it
REBUILD_TRIES = 5  # background rebuilds of a peer's path before giving up (a batch reconnects on demand)
_CONNECT_MS = 5000.0


class QpPool:
    """Queue pairs to peers (ours, pooled per (segment, path)) and for peers (served). Thread-safe."""

    def __init__(self, config: TransferConfig, tcp, nics: list[verbs.Nic], stats: PathStats):
        self._cfg, self._tcp, self._nics, self._stats = config, tcp, nics, stats
        self._token = secrets.token_hex(8)
        self._lock = threading.Condition()
        self._pools: dict[tuple, list[verbs.QueuePair]] = {}  # (segment, path) -> idle QPs
        self._counts: dict[tuple, int] = {}  # (segment, path) -> QPs existing
        self._peers: OrderedDict[str, tuple[dict, dict]] = OrderedDict()  # segment -> (tcp, rdma endpoints)
        self._rebuild: dict[tuple, int] = {}  # (segment, path) -> failed rebuild attempts
        self._served: OrderedDict[tuple, verbs.QueuePair] = OrderedDict()
        self._closed = threading.Event()
        self.nics_up = [True] * len(nics)  # port ACTIVE, per NIC (refreshed by the prober)
        tcp.server.set_control("rdma", self.serve_connect)
        self._thread = threading.Thread(target=self._prober, name="kvp-rdma-probe", daemon=True)
        self._thread.start()

    def remember(self, remote: SegmentDescriptor) -> None:
        """Note the peer's endpoints (most recently used last); past MAX_PEERS the oldest peer's QPs are closed."""
        with self._lock:
            self._peers[remote.segment_id] = (remote.transports["tcp"], remote.transports["rdma"])
            self._peers.move_to_end(remote.segment_id)
            if len(self._peers) <= MAX_PEERS:
                return
            old, _ = self._peers.popitem(last=False)
            keys = [k for k in self._pools if k[0] == old]
            idle = [q for k in keys for q in self._pools.pop(k)]
            for k in keys:
                self._counts.pop(k, None)
                self._rebuild.pop(k, None)
        for qp in idle:
            qp.close()

    def endpoint(self, seg: str) -> dict | None:
        """The rdma endpoint of peer ``seg`` as last seen, or None."""
        peer = self._peers.get(seg)
        return peer[1] if peer else None

    def idle(self) -> list[verbs.QueuePair]:
        """The pooled QPs not in a batch now (for inspection)."""
        with self._lock:
            return [q for pool in self._pools.values() for q in pool]

    def acquire(self, seg: str, path: Path, pieces: int, deadline: Deadline) -> tuple[list, str]:
        """Up to rdma_qps_per_peer idle QPs of (seg, path), connecting new ones as needed; ([], why) if none."""
        key, want = (seg, path), min(pieces, self._cfg.rdma_qps_per_peer)
        with self._lock:
            idle = self._pools.setdefault(key, [])
            got = [idle.pop() for _ in range(min(want, len(idle)))]
            new = min(want - len(got), self._cfg.rdma_qps_per_peer - self._counts.get(key, 0))
            self._counts[key] = self._counts.get(key, 0) + max(new, 0)
        why = ""
        for _ in range(max(new, 0)):
            try:
                got.append(self.connect(seg, path, deadline))
            except (TransferFailed, OSError, ValueError, KeyError) as e:
                why = f"connecting a queue pair failed: {e}"
                with self._lock:
                    self._counts[key] -= 1
                break
        if not got and not why:
            with self._lock:  # every QP of the path is busy in another batch: wait for one
                self._lock.wait_for(
                    lambda: self._pools.get(key) or self._closed.is_set(), timeout=max(0.0, deadline.remaining())
                )
                got = [self._pools[key].pop()] if self._pools.get(key) else []
            why = "" if got else "every queue pair of the path stayed busy until the deadline"
        return got, why

    def drop_dead(self, seg: str) -> None:
        """Close peer ``seg``'s idle QPs that died in the pool (a failed batch of the native fast path kills its
        QP without checking it out); the prober rebuilds them."""
        dead = []
        with self._lock:
            for key, idle in self._pools.items():
                gone = [q for q in idle if q.dead] if key[0] == seg else []
                for q in gone:
                    idle.remove(q)
                    self._counts[key] -= 1
                    self._rebuild.setdefault(key, 0)
                dead += gone
        for qp in dead:
            qp.close()

    def release(self, held: list[tuple[tuple, verbs.QueuePair]]) -> None:
        dead = []
        with self._lock:
            for key, qp in held:
                if qp.dead:
                    self._counts[key] -= 1
                    self._rebuild.setdefault(key, 0)
                    dead.append(qp)
                else:
                    self._pools.setdefault(key, []).append(qp)
            self._lock.notify_all()
        for qp in dead:
            qp.close()

    def connect(self, seg: str, path: Path, deadline: Deadline) -> verbs.QueuePair:
        """A new QP on local NIC path.local connected to a new QP the peer creates on its NIC path.remote."""
        tcp_ep, ep = self._peers[seg]
        qp = verbs.QueuePair(self._nics[path.local], self._cfg.rdma_queue_depth)
        try:
            body = {"kind": "rdma", "client": self._token, "nic": path.remote, **qp.local()}
            sub = Deadline(min(_CONNECT_MS, max(1.0, deadline.remaining() * 1000)))
            reply = self._tcp.control(tcp_ep, body, sub)
            qp.connect(reply)
        except Exception:
            qp.close()
            raise
        return qp

    def serve_connect(self, body: dict, addr) -> dict:
        """The peer's side of connect (a TCP control request, after the handshake): a QP on our NIC
        body["nic"] connected to the peer's. Raises ValueError for a malformed request."""
        nic = body.get("nic")
        if not isinstance(nic, int) or not 0 <= nic < len(self._nics):
            raise ValueError(f"nic={nic!r}: this process has RDMA NICs 0..{len(self._nics) - 1}")
        for k, kind in (("qpn", int), ("psn", int), ("lid", int), ("mtu", int), ("gid", str), ("client", str)):
            if not isinstance(body.get(k), kind) or isinstance(body.get(k), bool):
                raise ValueError(f"{k}={body.get(k)!r}: expected {kind.__name__}")
        if body["mtu"] not in verbs.MTU_ENUM:
            raise ValueError(f"mtu={body['mtu']}: one of {sorted(verbs.MTU_ENUM)}")
        qp = verbs.QueuePair(self._nics[nic], self._cfg.rdma_queue_depth)
        try:
            qp.connect(body)
        except Exception as e:
            qp.close()
            raise ValueError(f"connecting to QP {body['qpn']} failed: {e}") from None
        with self._lock:
            self._served[(body["client"], body["qpn"], nic)] = qp
            old = self._served.popitem(last=False)[1] if len(self._served) > MAX_SERVED_QPS else None
        if old is not None:
            old.close()
        return qp.local()

    def _prober(self) -> None:
        while not self._closed.wait(self._cfg.rdma_probe_ms / 1000):
            self.probe_once()

    def probe_once(self) -> None:
        """Refresh the NICs' port states and rebuild dead QPs into their pools (background thread)."""
        ups = [nic.port_active() for nic in self._nics]
        for nic, was, now in zip(self._nics, self.nics_up, ups):
            if was != now:
                log.warning("rdma NIC %s port is %s", nic.info.name, "ACTIVE again" if now else "down")
        self.nics_up = ups
        with self._lock:
            keys, self._rebuild = dict(self._rebuild), {}
        for (seg, path), tries in keys.items():
            if seg not in self._peers or self._closed.is_set():
                continue
            if not ups[path.local]:
                with self._lock:
                    self._rebuild[(seg, path)] = tries
                continue
            try:
                qp = self.connect(seg, path, Deadline(_CONNECT_MS))
            except (TransferFailed, OSError, ValueError, KeyError) as e:
                log.debug("rdma: rebuilding a QP to %s failed (%d of %d): %s", seg, tries + 1, REBUILD_TRIES, e)
                if tries + 1 < REBUILD_TRIES:
                    with self._lock:
                        self._rebuild[(seg, path)] = tries + 1
                continue
            self._stats.add("qp_rebuilds")
            self._stats.restore((seg, path.local, path.remote))
            with self._lock:
                self._counts[(seg, path)] = self._counts.get((seg, path), 0) + 1
                self._pools.setdefault((seg, path), []).append(qp)
                self._lock.notify_all()

    def stats(self) -> dict[str, Any]:
        """qps (ours), qps_served (for peers), nics_up."""
        with self._lock:
            return {"qps": sum(self._counts.values()), "qps_served": len(self._served), "nics_up": sum(self.nics_up)}

    def close(self) -> None:
        """Stop the prober (waiting for it: it may be using a NIC context the caller closes next) and close every
        queue pair. Idempotent."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(_CONNECT_MS / 1000 + 5)
        with self._lock:
            qps = [q for pool in self._pools.values() for q in pool] + list(self._served.values())
            self._pools.clear()
            self._served.clear()
            self._lock.notify_all()
        for qp in qps:
            qp.close()
