"""LeaderGuard: the object RpcServer serves in an HA master (duck-types MasterService: handle, tick,
zmq_endpoint; other attributes are the current MasterService's).

While this master leads, ops run on its MasterService, whose Journal is the EtcdJournal. On election the guard
builds a fresh MasterService and restores it from etcd (recovery.py) before answering any op; on losing the
lease it drops that state. A standby (or a leader still recovering) answers every op with a refusal that
starts with NOT_LEADER and names the leader, so clients (follower.py) look the leader up and retry.
All of it runs on the RpcServer's single thread; the Elector's thread only flips its lease state.
"""

from __future__ import annotations

import json
import logging
import time

from kvplugins.errors import StoreError
from kvplugins.store.wire.protocol import NOT_LEADER
from kvplugins.store.master.ha import recovery
from kvplugins.store.master.metadata import FRONT_PUT
from kvplugins.store.master.service import MasterService

log = logging.getLogger(__name__)
LOOKUP_CACHE_S = 0.1  # a standby's refusals name the leader it read from etcd at most this long ago


class LeaderGuard:
    """``cfg``: MasterConfig; ``journal``: EtcdJournal. Set ``elector`` (election.Elector) before serving.
    ``shard``: the shard role (shard/master.py) the leader's service gets, or None."""

    def __init__(self, cfg, journal, elector=None, shard=None):
        self.cfg, self.journal, self.elector, self.shard = cfg, journal, elector, shard
        self.zmq_endpoint = ""
        self.active = False
        self.grouped = False  # set by group_commit.GroupCommit: replies wait for sync()
        self.recovered: dict = {}
        self._looked_up: tuple[float, bytes | None] = (-LOOKUP_CACHE_S, None)  # (when, leader value)
        self.inner = MasterService(cfg)  # a standby's empty placeholder (never journals)
        self.prober = None  # the RPC server's admission.Prober, handed to each leader service

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def handle(self, op: str, entries, opts, defer: bool = False, caller: str = ""):
        """MasterService.handle on the leader. Raises ValueError('not leader; the leader is ...') elsewhere."""
        return self._journaled(lambda: self.inner.handle(op, entries, opts, defer, caller))

    def serve_native(self, body: bytes, ops: int):
        """MasterService.serve_native of reads on the leader; None elsewhere (the Python path answers "not
        leader") and for puts, which the Python path journals."""
        return self.inner.serve_native(body, ops & ~FRONT_PUT) if self._check() else None

    def step(self, scan) -> bool:
        """MasterService.step on the leader (a deferred op: admin scan or sliced batch), journaled like an op."""
        return self._journaled(lambda: self.inner.step(scan))

    def _journaled(self, fn):
        if not self._check():
            raise ValueError(self._refusal())
        if self.grouped:  # the server holds the reply until sync() persisted the batch
            self.journal.begin()
            return fn()
        try:
            with self.journal.batch():  # persisted before the reply is sent
                out = fn()
        except StoreError as e:  # the journal could not persist: the op is not acknowledged
            raise ValueError(str(e)) from e
        self.journal.rewrite_some()
        return out

    def sync(self) -> None:
        """Group commit (group_commit.py): persist the writes of every op since the last sync, before the
        server sends their replies, then a share of the deferred record rewrites (EtcdJournal.replicas_lost).
        Raises StoreError if the writes could not be persisted."""
        self.journal.commit()
        self.journal.rewrite_some()

    def tick(self) -> None:
        if self._check():
            try:
                with self.journal.batch():
                    self.inner.tick()
            except StoreError as e:  # etcd down: memory is ahead of etcd; a successor re-expires it
                log.warning("sweep not persisted: %s", e)

    def _check(self) -> bool:
        leader = self.elector is not None and self.elector.is_leader()
        if leader and not self.active:
            try:
                self._take_over()
            except StoreError as e:
                log.warning("elected, but recovery from etcd failed (retrying): %s", e)
        elif not leader and self.active:
            self._step_down()
        return self.active

    def _take_over(self) -> None:
        t0 = time.monotonic()
        self.journal.drop_deferred()
        self.journal.fence = self.elector.value
        self.journal.on_fenced = self.elector.lost
        service = MasterService(self.cfg, zmq_endpoint=self.zmq_endpoint, journal=self.journal, shard=self.shard)
        service.prober = self.prober
        segs, objs, slabs = self.journal.load()
        owners, parked = self.journal.load_owners(), self.journal.load_parked()
        with self.journal.batch():  # what recovery rewrites (ended tasks, held records) in MAX_TXN_OPS batches
            self.recovered = recovery.restore(service, segs, objs, service.clock(), slabs, owners, parked)
            self.recovered["tasks"] = recovery.restore_tasks(service, self.journal.load_tasks(), service.clock())
            flights = recovery.hold_flights(service, self.journal.load_flights(), service.clock())
            self.recovered["flight_bytes"] = flights
        service.segments.restart_clocks(service.clock())
        self.inner, self.active = service, True
        log.warning(
            "leader now: recovered %d segments, %d objects (%d of them pending puts, %d on disk only, %d dropped, "
            "%d short of replicas: queued for copies), %d bytes of slabs and %d of disk-tier flights held, %d "
            "replica tasks in %.0f ms",
            self.recovered["segments"],
            self.recovered["objects"],
            self.recovered["pending"],
            self.recovered["disk_only"],
            self.recovered["dropped"],
            self.recovered["short"],
            self.recovered["slab_bytes"],
            self.recovered["flight_bytes"],
            self.recovered["tasks"],
            (time.monotonic() - t0) * 1000,
        )

    def _step_down(self) -> None:
        log.warning("no longer leader: dropping the in-memory metadata (the new leader recovers it from etcd)")
        self.journal.drop_deferred()
        self.inner, self.active = MasterService(self.cfg, zmq_endpoint=self.zmq_endpoint), False

    def _refusal(self) -> str:
        now = time.monotonic()
        if now - self._looked_up[0] > LOOKUP_CACHE_S:  # a client hammering a standby costs etcd little
            try:
                self._looked_up = (now, self.journal.etcd.get(self.journal.leader_key))  # this thread's client
            except Exception as e:  # noqa: BLE001 - the refusal is answered whatever etcd does
                self._looked_up = (now, None)
                log.info("leader lookup failed: %s", e)
        value = self._looked_up[1]
        if value is None:
            return f"{NOT_LEADER}; no leader is elected yet (retry shortly)"
        if self.elector is not None and value == self.elector.value:
            return f"{NOT_LEADER}; this master was just elected and is recovering (retry shortly)"
        leader = json.loads(value)
        return f"{NOT_LEADER}; the leader is {leader['raw']} (control plane {leader['zmq']})"
