"""The master's disk tier (issue #6): offload on evict, promote on hit, drain — what eviction does with a victim
and how a get answers a disk-resident object.

MasterService owns one Tiering and calls evict/get/dropped/tick/status; ops() adds the tier's RPC ops. Until a
store node with ``--disk-dir`` registers its tier, an evicted object is dropped (no disk tier).

* Offload (watermark sweep, ``urgent=False``): an ``offload`` command is queued for every node holding a replica
  that has a tier (so an object put with 2 replicas keeps 2 disk copies on 2 hosts); each node polls
  (``tier_poll``), writes the file durably and confirms (``tier_done``); only once every such node holds its
  copy are the DRAM replicas freed (when the last reader's lease ends) and the object is disk-only. The sweep is no emergency: a
  victim whose tier cannot take it now (backing off after a failed offload, e.g. a full disk, or not yet known
  to a leader that just took over) stays in DRAM for a later sweep instead of being dropped. On-demand eviction
  (``urgent=True``, a put is waiting) never waits for disk: an object with a clean disk copy (promoted earlier)
  has its DRAM freed at once, even with fewer copies than replicas; any other victim is dropped (an offload in flight is cancelled, its file deleted).
* Promote: a get of a disk-only object answers ``[ON_DISK, [node endpoint, size]]``; the client asks that node
  (kvplugins.store.client.promote), which calls ``promote_start`` (a DRAM offset in its own segment), loads and
  verifies the file there, and ``promote_commit``s; the object is in DRAM again and keeps its clean disk copy.
* Drain (``drain``; master/drain.py): the segment takes no new placements; its objects are migrated by its node.
Disk-only objects hold no DRAM: they are parked outside the table's LRU lists, so eviction never picks them.
"""

from __future__ import annotations

import heapq
import logging
from itertools import islice

from kvplugins.store.master import drain
from kvplugins.store.master.disk_state import (
    FLIGHT_TIMEOUT_S,
    POLL_BATCH,
    TTL_MARGIN_S,
    Copy,
    DiskNode,
    Flight,
    raw_allocator,
)
from kvplugins.store.master.eviction import victims
from kvplugins.store.master.replica_tasks import ReplicaTasks
from kvplugins.store.wire.protocol import EXISTS, NOT_FOUND, OK, ON_DISK, STORE_FULL

log = logging.getLogger(__name__)
COUNTERS = (
    "offloads",
    "offload_failures",
    "offload_deferred",
    "promotions",
    "promote_failures",
    "disk_hits",
    "disk_corrupt",
    "disk_evicted",
    "disk_lost",
    "migrations",
    "migrate_failures",
    "drains",
)
LOST_COUNTER = {"evicted": "disk_evicted", "corrupt": "disk_corrupt"}
CLEAN_SCAN = 256  # a promotion looks this far down the LRU for a victim that is already on disk
OFFLOAD_BACKOFF_S = 1.0  # after a failed offload (disk full, I/O error) the node gets no offload this long
TIER_LEARN_S = 5.0  # a new master (an HA leader that took over) learns the nodes' tiers within this


class Tiering:
    def __init__(self, service=None):
        self.service = service
        self.nodes: dict[str, DiskNode] = {}  # segment name -> node tier
        self.copies: dict[str, dict[str, Copy]] = {}  # key -> node segment -> its disk copy there
        self.flights: dict[str, Flight] = {}  # key -> the copy in flight
        self.disk_bytes = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.tasks = ReplicaTasks(self)  # replica copy/move tasks (master/replica_tasks.py)
        self._fid = 0
        self._learn_until = 0.0  # after an HA takeover: until then, nodes' tiers may still be unknown (_unlearnt)
        self._awaiting: list = []  # recovered disk-only objects, dropped at _learn_until if no tier named them
        self._held: list[tuple[float, int]] = []  # heap (until, fid): ended flights whose journal record stays
        # while their destination waits out a late write

    # ---- hooks the service calls ---------------------------------------------------------------------
    def evict(self, obj, now: float, urgent: bool) -> bool:
        """Eviction chose ``obj``. Return True if the tier took it over (the service must not drop it), False to
        let the service drop it. ``urgent``: a put is waiting for the space now (on-demand eviction), so only a
        step that frees DRAM at once helps; False from the watermark sweep. After True, ``obj`` must no longer be a
        victim (eviction.victims) or its DRAM must be free, or the on-demand loop would pick it again."""
        have = {c.segment for c in self.copies_of(obj)}
        missing = [n for n in self._tiers_of(obj) if n.segment not in have]
        if have and (urgent or not missing):
            self.to_disk_only(obj, now, max(now, obj.lease_until))  # clean copies: DRAM goes at once
            return True
        if urgent:
            return False  # a flight of obj is cancelled by dropped(); the node's file is then deleted
        if obj.key in self.flights or any(n in self.nodes and self.nodes[n].draining for n, _ in obj.replicas):
            self.counters["offload_deferred"] += 1  # already on its way to disk, or the drain moves it
            return True
        ready = [n for n in missing if n.retry_at <= now]
        if not ready:
            if missing or self._unlearnt(obj, now):  # a tier backing off, or one not heard yet
                self.counters["offload_deferred"] += 1  # the sweep is no emergency: keep it for its tiers
                return True
            return False
        seg = self.service.segments.get(ready[0].segment)
        if seg.used - ready[0].offloading <= self.service.cfg.low_watermark * seg.size:
            self.counters["offload_deferred"] += 1  # offloads in flight already bring it under low
            return True
        at = dict(obj.replicas)
        f = Flight("offload", obj, ready[0].segment, now + FLIGHT_TIMEOUT_S, pending={n.segment for n in ready})
        self.flights[obj.key] = f
        for node in ready:
            node.offloading += obj.size
            node.queue.append(["offload", obj.key, at[node.segment], obj.size, _checksum(obj)])
        return True

    def get(self, obj, now: float):
        """A get found ``obj`` complete but with no DRAM replica on a live segment: ``[ON_DISK, [node endpoint, size]]`` (promote it
        through that node, kvplugins.store.client.promote) or ``[NOT_FOUND, None]``."""
        c = self.copy(obj)
        if c is None or not self.nodes[c.segment].endpoint:
            return [NOT_FOUND, None]
        self.counters["disk_hits"] += 1
        return [ON_DISK, [self.nodes[c.segment].endpoint, obj.size]]

    def dropped(self, obj, now: float) -> None:
        """``obj`` is leaving the table (remove, eviction, loss): delete its disk copy, cancel its flight (a
        destination the node may still write is freed after put_timeout_ms)."""
        if any(c.obj == obj for c in self.copies.get(obj.key, {}).values()):
            self.forget_copy(obj.key, delete=True)
        f = self.flights.get(obj.key)
        if f is not None and f.obj == obj:
            self.end_flight(obj.key, now, free_dest_at=now + self.service.cfg.put_timeout_ms / 1000)

    def keeps(self, obj) -> bool:
        """``obj`` lost its last DRAM replica (its segment left). True if it lives on as a disk-only object (it
        has a disk copy on a live node), False to let the service drop it."""
        if not obj.complete or self.copy(obj) is None:
            return False
        self.service.table.park(obj)
        return True

    def took_over(self, now: float) -> None:
        """This master recovered an HA leader's state: the nodes' tiers are learnt from their next poll."""
        self._learn_until = now + TIER_LEARN_S

    def await_copies(self, objs: list) -> None:
        """Recovered disk-only objects (the journal keeps no disk copies): a node's tier registration names each
        copy again (_adopt); one no tier has named by the end of TIER_LEARN_S is dropped (tick). Until then the
        key exists, so no put re-stores it meanwhile and its disk copies are adopted, not deleted as stale."""
        self._awaiting += objs

    def disk_only_object(self, key: str, size: int, checksum, now: float, pin: int = 0):
        """A new complete object of ``size`` bytes with no DRAM replica, parked out of the LRU lists (eviction
        never walks it): one a tier announced (_adopt), or one a new HA leader recovered (ha/recovery.py)."""
        obj = self.service.table.new(key, size, [], complete=True, last_access=now, checksum=checksum, pin=pin)
        self.service.table.park(obj)
        return obj

    def _drop_unclaimed(self, now: float) -> None:
        table, gone = self.service.table, []
        for obj in self._awaiting:
            if obj.alive() and table.get(obj.key) == obj and not obj.replicas and not self.copies_of(obj):
                gone.append(obj)
        self._awaiting = []
        for obj in gone:
            self.service.drop(obj, now)
        self.counters["disk_lost"] += len(gone)
        if gone:
            log.warning("%d recovered disk-only objects dropped: no node's tier named a copy within %.0f s of the "
                        "takeover (a tier that registers later adds them back)", len(gone), TIER_LEARN_S)  # fmt: skip

    def ops(self) -> dict:
        """Extra RPC ops: name -> fn(entries, opts, now)."""
        return {
            "tier_register": self.op_tier_register,
            "tier_poll": self.op_tier_poll,
            "tier_done": self.op_tier_done,
            "promote_start": self.op_promote_start,
            "promote_commit": self.op_promote_commit,
            "drain": self.op_drain,
            "task_create": self.tasks.op_task_create,
            "task_query": self.tasks.op_task_query,
        }

    def tick(self, now: float) -> None:
        """Called on every master sweep: forget nodes whose segment left, abandon flights past their deadline."""
        if self._awaiting and now >= self._learn_until:
            self._drop_unclaimed(now)
        for name in [n for n in self.nodes if self.service.segments.get(n) is None]:
            self.lose_node(name, now)
        for key in [k for k, f in self.flights.items() if f.deadline <= now]:
            self.end_flight(key, now, free_dest_at=now + self.service.cfg.put_timeout_ms / 1000)
        while self._held and self._held[0][0] <= now:
            self.service.journal.flight_ended(heapq.heappop(self._held)[1])
        self.tasks.tick(now)

    def status(self) -> dict:
        """Merged into the ``status`` op's answer."""
        return {
            **self.counters,
            "disk_objects": len(self.copies),
            "disk_copies": sum(len(c) for c in self.copies.values()),
            "disk_bytes": self.disk_bytes,
            "disk_flights": len(self.flights),
            "disk_capacity": sum(n.capacity for n in self.nodes.values()),
            "draining": sorted(n.segment for n in self.nodes.values() if n.draining),
            "tier_segments": {
                n.segment: {"disk_objects": len(n.keys), "disk_capacity": n.capacity, "draining": n.draining}
                for n in self.nodes.values()
            },
        }

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def copies_of(self, obj) -> list[Copy]:
        """``obj``'s valid disk copies (on nodes the master knows)."""
        return [c for c in self.copies.get(obj.key, {}).values() if c.obj == obj and c.segment in self.nodes]

    def copy(self, obj) -> Copy | None:
        """A disk copy of ``obj`` a reader can promote from: on a node whose segment is not suspect if there is
        one, else any valid copy; None without one."""
        found = self.copies_of(obj)
        suspect = self.service.segments.suspect
        return next((c for c in found if c.segment not in suspect), found[0] if found else None)

    def add_copy(self, obj, segment: str, checksum: int) -> None:
        held = self.copies.get(obj.key, {})
        if any(c.obj != obj for c in held.values()):
            self.forget_copy(obj.key, delete=False)  # copies of an older object of this key
        self.forget_copy(obj.key, delete=False, segment=segment)
        self.copies.setdefault(obj.key, {})[segment] = Copy(segment, obj, checksum)
        self.nodes[segment].keys.add(obj.key)
        self.disk_bytes += obj.size

    def forget_copy(self, key: str, delete: bool, segment: str | None = None) -> None:
        """Forget ``key``'s disk copies (only the one on node ``segment`` if given); ``delete``: tell their nodes
        to delete the files."""
        held = self.copies.get(key)
        if not held:
            return
        for name in [segment] if segment is not None else list(held):
            c = held.pop(name, None)
            if c is None:
                continue
            self.disk_bytes -= c.size
            node = self.nodes.get(name)
            if node is not None:
                node.keys.discard(key)
                if delete:
                    node.queue.append(["delete", key])
        if not held:
            del self.copies[key]

    def to_disk_only(self, obj, now: float, free_at: float) -> None:
        """Free ``obj``'s DRAM replicas (at ``free_at``) and leave it on disk only."""
        svc = self.service
        held = [(svc.segments.get(name), off) for name, off in obj.replicas]
        obj.replicas = []
        svc.table.park(obj)  # out of the LRU: eviction scans never walk disk-only objects
        self.free_at(held, free_at, now)
        svc.journal.replicas_changed([obj])
        svc.events.offloaded([obj])

    def free_at(self, held: list, at: float, now: float) -> None:
        """Free [(Segment, offset)] now or, through the service's zombie heap, at ``at``."""
        svc = self.service
        if at > now:
            svc.zombies.add(at, held)
            return
        for seg, off in held:
            if seg is not None:
                seg.allocator.free(off)

    def migrate(self, obj, source: str, dest, off: int, now: float) -> Flight:
        """Start a migrate flight of ``obj`` from node ``source``'s segment (``src`` offset, -1: its disk) to
        (dest Segment, off), and queue the node's command (drain and replica tasks)."""
        f = self._start(Flight("migrate", obj, source, now + FLIGHT_TIMEOUT_S, dest=(dest, off)))
        src = dict(obj.replicas).get(source, -1)
        self.nodes[source].queue.append(["migrate", obj.key, obj.size, src, dest.name, dest.region_id, off, f.fid])
        return f

    def _start(self, f: Flight) -> Flight:
        """Record flight ``f`` of a DRAM destination under a new id, journaled (a new HA leader holds it)."""
        self._fid += 1
        f.fid = self._fid
        self.flights[f.obj.key] = f
        seg, off = f.dest
        align = self.service.cfg.alloc_align
        self.service.journal.flight_started(f.fid, seg.name, off, off + -(-f.size // align) * align)
        return f

    def migrating(self, segment: str) -> int:
        """Migrate flights whose source is node ``segment``."""
        return sum(1 for f in self.flights.values() if f.segment == segment and f.kind == "migrate")

    def end_flight(self, key: str, now: float, free_dest_at: float | None = None) -> Flight | None:
        """Close ``key``'s flight; a destination is freed at ``free_dest_at``."""
        f = self.flights.pop(key, None)
        if f is None:
            return None
        if f.dest is not None and free_dest_at is not None and free_dest_at > now:
            heapq.heappush(self._held, (free_dest_at, f.fid))  # a late write may land until then
        elif f.dest is not None:
            self.service.journal.flight_ended(f.fid)
        for name in f.pending if f.kind == "offload" else ():
            if name in self.nodes:
                self.nodes[name].offloading -= f.size
        if f.dest is not None and free_dest_at is not None:
            self.free_at([f.dest], free_dest_at, now)
        return f

    def lose_node(self, name: str, now: float) -> None:
        """Node ``name``'s segment left: its files stay on its disk (announced again when it returns), so the
        master forgets them without deleting; objects that were only there are lost."""
        for key in [k for k, f in self.flights.items() if f.segment == name or name in f.pending]:
            f = self.flights[key]
            if f.kind == "offload" and len(f.pending) > 1:  # the other nodes' copies are still coming
                self.nodes[name].offloading -= f.size
                f.pending.discard(name)
                f.segment = next(iter(f.pending))
                continue
            self.end_flight(key, now, free_dest_at=now + self.service.cfg.put_timeout_ms / 1000)
        node = self.nodes.pop(name)
        lost = []
        for key in list(node.keys):
            c = self.copies.get(key, {}).get(name)
            if c is None:
                continue
            self.forget_copy(key, delete=False, segment=name)
            if self.service.table.get(key) == c.obj and not c.obj.replicas and not self.copies_of(c.obj):
                lost.append(c.obj)
        for obj in lost:
            self.service.drop(obj, now)
        self.counters["disk_lost"] += len(lost)

    def _unlearnt(self, obj, now: float) -> bool:
        """Whether this master took over as HA leader less than TIER_LEARN_S ago (it learns the nodes' tiers from
        their next poll) and a replica's node has not registered a tier yet: a tier may take ``obj`` later."""
        return now < self._learn_until and any(name not in self.nodes for name, _ in obj.replicas)

    def _tiers_of(self, obj) -> list[DiskNode]:
        """The tiers that can hold a copy of ``obj``: those of its DRAM replicas' nodes (distinct segments, so
        one per node), not draining, big enough."""
        nodes = (self.nodes.get(name) for name, _ in obj.replicas)
        return [n for n in nodes if n is not None and n.endpoint and not n.draining and obj.size <= n.capacity]

    def flight(self, key, kind: str, segment: str):
        """The flight of ``kind`` for ``key`` by node ``segment`` if its object is still the table's."""
        f = self.flights.get(key)
        if f is None or f.kind != kind or (f.segment != segment and segment not in f.pending):
            return None
        return f if self.service.table.get(key) == f.obj else None

    # ---- ops: node registration and commands ---------------------------------------------------------
    def op_tier_register(self, entries, opts, now):
        """[[segment, endpoint, capacity bytes, [[key, size, checksum], ...], disk id]] -> [[OK, keys to delete]]:
        a node (re)joins with the objects already on its disk; unknown keys become disk-only objects. A node
        record with the same disk id (a restarted process whose old segment has not timed out yet) is replaced.
        opts {"more": 1}: further files of a node that registered already (a big disk announces in chunks)."""
        out = []
        for node in entries:  # schema.TierNode
            segment, disk_id = node.segment, node.disk_id
            if self.service.segments.get(segment) is None:
                out.append([NOT_FOUND, f"segment {segment} is not registered"])
                continue
            if not (opts.more and segment in self.nodes):
                for old in [
                    n.segment for n in self.nodes.values() if n.segment == segment or (disk_id and n.disk_id == disk_id)
                ]:
                    self.lose_node(old, now)  # the same node again, or its disk under a restarted process
                self.nodes[segment] = DiskNode(segment, node.endpoint, node.capacity, disk_id)
            out.append([OK, self._adopt(segment, node.files, now)])
        return out

    def _adopt(self, segment: str, files, now: float) -> list[str]:
        table, stale, new = self.service.table, [], []
        for key, size, digest in files:
            obj = table.get(key)
            if obj is None:
                obj = self.disk_only_object(key, size, digest, now)
                new.append(obj)
            elif not (obj.complete and obj.size == size and _checksum(obj) in (0, digest)):
                stale.append(key)
                continue
            self.add_copy(obj, segment, digest)
        if new:
            self.service.journal.committed(new)
            self.service.events.stored(new)
        return stale

    def op_tier_poll(self, entries, opts, now):
        """[segment] -> [[OK, [commands, {segment: descriptor}]]] or [[NOT_FOUND, None]] (register again)."""
        out = []
        for segment in entries:
            node = self.nodes.get(segment)
            if node is None:
                out.append([NOT_FOUND, None])
                continue
            if node.draining:
                drain.plan(self, node, now)
            cmds, node.queue = node.queue[:POLL_BATCH], node.queue[POLL_BATCH:]
            cmds = [c + [self._ttl_ms(c, now)] if c[0] == "migrate" else c for c in cmds]
            names = {c[4] for c in cmds if c[0] == "migrate"}
            out.append(
                [
                    OK,
                    [
                        cmds,
                        {
                            n: self.service.segments.get(n).descriptor
                            for n in names
                            if self.service.segments.get(n) is not None
                        },
                    ],
                ]
            )
        return out

    def _ttl_ms(self, cmd: list, now: float) -> float:
        """How long after the poll the node may still start this migrate command: until TTL_MARGIN_S before its
        flight's deadline; 0 when its flight has ended (the node then reports it expired without writing)."""
        f = self.flights.get(cmd[1])
        if f is None or f.fid != cmd[7]:
            return 0.0
        return max(0.0, (f.deadline - now - TTL_MARGIN_S) * 1000)

    def op_tier_done(self, entries, opts, now):
        """[[kind, key, ok, detail, flight id], ...] with opts {segment}: results of polled commands (a migrate's
        flight id as its command carried it; 0 for the others), and ``evicted`` / ``corrupt`` reports of files the
        node lost."""
        segment = opts.segment
        if segment not in self.nodes:
            return [[NOT_FOUND, None] for _ in entries]
        for kind, key, ok, detail, fid in entries:
            if kind == "offload":
                self._offloaded(key, segment, ok, detail, now)
            elif kind == "migrate":
                f = self.flight(key, "migrate", segment)
                if f is None or f.fid != fid:
                    continue  # a late report of an ended flight: its destination is handled
                task = self.tasks.by_fid.get(fid)
                if task is not None:
                    self.tasks.migrated(task, ok, detail, now)
                else:
                    drain.migrated(self, key, segment, ok, detail, now)
            elif kind in ("evicted", "corrupt"):
                self.file_lost(key, segment, kind, now)
        return [[OK, None] for _ in entries]

    def _offloaded(self, key, segment: str, ok: bool, digest, now: float) -> None:
        f = self.flight(key, "offload", segment)
        if f is None or segment not in f.pending:  # cancelled (removed) or timed out: nobody wants that file
            if ok and segment not in self.copies.get(key, {}):
                self.nodes[segment].queue.append(["delete", key])
            return
        f.pending.discard(segment)
        self.nodes[segment].offloading -= f.size
        if ok:
            self.add_copy(f.obj, segment, int(digest))
        else:
            self.counters["offload_failures"] += 1
            self.nodes[segment].retry_at = now + OFFLOAD_BACKOFF_S  # a failing disk acts as none for a while
        if f.pending:
            f.segment = next(iter(f.pending))
            return
        self.end_flight(key, now)
        have = {c.segment for c in self.copies_of(f.obj)}
        if have and all(n.segment in have for n in self._tiers_of(f.obj)):
            self.to_disk_only(f.obj, now, max(now, f.obj.lease_until))  # readers that got it keep their lease
            self.counters["offloads"] += 1  # (else it stays in DRAM: a later sweep writes the missing copies)

    def file_lost(self, key, segment: str, why: str, now: float) -> None:
        """Node ``segment`` no longer has ``key``'s file (``why``: "evicted" by its LRU, "corrupt", "missing");
        an object that was only there is dropped (a miss from now on)."""
        c = self.copies.get(key, {}).get(segment)
        if c is None:
            return
        self.forget_copy(key, delete=False, segment=segment)
        self.counters[LOST_COUNTER.get(why, "disk_lost")] += 1
        gone = not c.obj.replicas and not self.copies_of(c.obj) and key not in self.flights
        if self.service.table.get(key) == c.obj and gone:
            self.service.drop(c.obj, now)

    # ---- ops: promote on hit -------------------------------------------------------------------------
    def op_promote_start(self, entries, opts, now):
        """[key, ...] with opts {segment}: a DRAM offset in that node's segment for each disk-only key it holds
        (or whose every DRAM replica is on a suspect segment) -> [[OK, [offset, size]] | [EXISTS, "in DRAM"/"busy"]
        | [NOT_FOUND, None] | [STORE_FULL, reason]]."""
        segment = opts.segment
        seg = self.service.segments.get(segment)
        if seg is None or segment not in self.nodes:
            return [[NOT_FOUND, f"segment {segment} is not a registered disk node"] for _ in entries]
        out = []
        for key in entries:
            obj = self.service.table.get(key)
            held = {c.segment for c in self.copies_of(obj)} if obj is not None else set()
            in_dram = obj is not None and any(n not in self.service.segments.suspect for n, _ in obj.replicas)
            if obj is not None and (in_dram or key in self.flights):
                out.append([EXISTS, "in DRAM" if in_dram else "busy"])
            elif segment not in held:
                out.append([NOT_FOUND, None])
            else:
                out.append(self._promote_alloc(obj, seg, now))
        return out

    def alloc_on(self, seg, alloc, size: int, now: float) -> int | None:
        """An offset of ``size`` bytes from ``alloc`` (segment ``seg``'s allocator), evicting only ``seg``'s own
        LRU objects (those already on disk first: freeing them loses nothing); None when nothing there can go."""
        while (off := alloc.alloc(size)) is None:
            found = list(islice(victims(self.service.table, now, self.service.grace_cutoff(now), seg.name), CLEAN_SCAN))
            victim = next((v for v in found if self.copy(v) is not None), found[0] if found else None)
            if victim is None:
                return None
            self.service.evict(victim, now, urgent=True)
        return off

    def _promote_alloc(self, obj, seg, now: float):
        off = self.alloc_on(seg, raw_allocator(seg), obj.size, now)
        if off is None:
            self.counters["promote_failures"] += 1
            return [STORE_FULL, f"segment {seg.name} has no room for {obj.size} bytes"]
        deadline = now + self.service.cfg.put_timeout_ms / 1000
        self._start(Flight("promote", obj, seg.name, deadline, dest=(seg, off)))
        return [OK, [off, obj.size]]

    def op_promote_commit(self, entries, opts, now):
        """[[key, ok, detail], ...] with opts {segment}: the node loaded (or failed to load) each started key."""
        segment, out = opts.segment, []
        for key, ok, detail in entries:
            f = self.flight(key, "promote", segment)
            if f is None:
                out.append([NOT_FOUND, "no promotion in flight (removed or timed out)"])
                continue
            if not ok:
                self.end_flight(key, now, free_dest_at=now)
                self.counters["promote_failures"] += 1
                self.file_lost(key, segment, detail, now)
                out.append([OK, None])
                continue
            self.end_flight(key, now)  # its destination becomes the object's replica
            seg, off = f.dest
            obj = f.obj
            obj.replicas = [*obj.replicas, (seg.name, off)]  # replicas on suspect segments stay (they may return)
            obj.lease_until = now + self.service.cfg.lease_ttl_ms / 1000  # until the client's get re-asks
            self.service.table.unpark(obj, now)
            self.service.journal.replicas_changed([obj])
            self.service.events.promoted([obj])
            self.counters["promotions"] += 1
            out.append([OK, None])
        return out

    # ---- ops: drain ----------------------------------------------------------------------------------
    def op_drain(self, entries, opts, now):
        """[segment, ...] -> [[OK, None] | [NOT_FOUND, reason]]: start draining those nodes."""
        return [drain.start(self, name, now) for name in entries]


def _checksum(obj) -> int:
    """The object's checksum as put (0 = unknown)."""
    return obj.checksum or 0
