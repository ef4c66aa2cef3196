"""The master's logic: one batch operation per RPC op, no I/O, single-threaded (rpc_server.py calls it).

Put = ``put_start`` (allocate; object pending) -> the client writes through the transfer core ->
``put_commit`` (complete); or, in one round trip, the client writes into space it reserved earlier and sends
``put`` (slabs.py). Get = ``get`` (lookup + lease) -> the client reads. Memory of a removed object that
is leased (or pending) is freed only when the lease (or the put deadline) runs out ("zombies"), so a reader
or late writer never lands in reallocated space. Follows the Mooncake master_service design (FAST'25 §4).
"""

from __future__ import annotations

import functools
import logging
import time


from kvplugins.store.config import MasterConfig
from kvplugins.store.master import admin_ops, admission, batches, liveness
from kvplugins.store.master import placement
from kvplugins.store.master.events import NoEvents
from kvplugins.store.master.eviction import (
    expire_soft_pins,
    hard_pinned_bytes,
    next_evictable,
    over_high,
    victims,
    young_bytes,
)
from kvplugins.store.master.journal import Journal
from kvplugins.store.master.metadata import FRONT_GET, FRONT_PUT, Object, ObjectTable
from kvplugins.store.master.quotas import Quotas, refuse
from kvplugins.store.master.repair import Repairs
from kvplugins.store.master.segments import Segment, SegmentOwned, SegmentRegistry, TooMany, owner_digest
from kvplugins.store.master.slabs import Slabs
from kvplugins.store.master.tiering import Tiering
from kvplugins.store.master.zombies import Zombies
from kvplugins.store.wire.protocol import (
    EXISTS,
    EXPIRED,
    INVALID,
    NOT_FOUND,
    OK,
    ON_DISK,
    PENDING,
    STORE_FULL,
    UNREACHABLE,
    VERSION,
)
from kvplugins.store.wire.schema import Schemas

log = logging.getLogger(__name__)
COUNTERS = (
    "hits",
    "misses",
    "puts",
    "put_skipped",
    "put_full",
    "commits",
    "aborts",
    "removes",
    "evictions",
    "reclaimed",
    "segments_suspect",
    "segments_lost",
    "objects_lost",
    "objects_restored",
    "corrupt_replicas",
    "segments_refused",
    "lookup_keys",
    "lookup_hits",
    "repairs_started",
    "repairs_given_up",
)


SHARD_ROUTED = ("put_start", "put")
FRONT_MAX_KEYS = 4096  # keys of one request the native front takes: ~1 ms of the loop (a Python slice of 512 ~5 ms)
EVICT_PER_CALL = 128  # watermark evictions per op or sweep, beyond twice the op's own new objects (evict_watermarks)
RESCAN_MAX_S = 0.1  # a scan that found nothing evictable runs again by then at the latest (objects a returning
# segment or the disk tier restores with their old commit time are evictable at once)


class MasterService:
    """Batch operations on the object table and segment registry. ``clock`` returns seconds (tests inject).

    Its parts (``tiering`` and drain.py for the disk tier, ``slabs``, admin_ops.py) work through the service's
    own operations, all on the service thread: ``place`` (space for new replicas, evicting on demand),
    ``evict`` (eviction chose an object: offload or drop), ``drop`` (remove an object, its space freed now or
    when its lease ends), ``free_due_zombies`` and ``zombies`` (space of removed objects still leased), plus
    ``table``, ``segments``, ``journal``, ``events`` and ``counters``."""

    def __init__(
        self,
        config: MasterConfig,
        clock=time.monotonic,
        zmq_endpoint: str = "",
        journal: Journal | None = None,
        tiering: Tiering | None = None,
        shard=None,
    ):
        self.cfg, self.clock, self.zmq_endpoint = config, clock, zmq_endpoint
        # serve_native's limits: keys per request, key bytes, a get's lease (ms)
        self._front_limits = (min(config.max_batch, FRONT_MAX_KEYS), config.max_key_bytes, config.lease_ttl_ms)
        self.shard = shard  # shard/master.py ShardMember of a sharded store's master, else None
        self.journal = journal or Journal()
        self.tiering = tiering or Tiering()
        self.tiering.service = self
        self.events = NoEvents()  # KV events (master/events.py): the RPC server installs a publisher
        self.prober = None  # admission.Prober: the RPC server installs one (segments probed first)
        self.events_endpoints = ("", "")  # (PUB, replay) where events are published; empty when off
        self.table = ObjectTable()
        self.segments = SegmentRegistry(config.alloc_align)
        self.manifests = liveness.Manifests(self._manifest_dropped)  # objects of segments removed for silence
        self.repairs = Repairs(self)  # objects short of the replicas they had, and their copy tasks (repair.py)
        self.journal.wanted = self.repairs.wanted  # journaled, so a new HA leader copies them too
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.quotas = Quotas(config, lambda: sum(s.size for s in self.segments))
        self.caller = ""  # identity of the request being run (master/quotas.py; "" = the cluster)
        self.schemas = Schemas.of(config)
        self.zombies = Zombies()  # space of removed objects, freed when their leases / put deadlines end
        # segments on their way from the high watermark to the low one -> the master-clock time the next
        # eviction scan of it is worth running (evict_watermarks)
        self._draining: dict[str, float] = {}
        self._ops = {name[3:]: getattr(self, name) for name in dir(self) if name.startswith("op_")}
        self._ops.update(self.tiering.ops())
        self._ops.update(admin_ops.ops(self))  # get_size, remove_by_regex, remove_all (compat)
        self.slabs = Slabs(self)
        self._ops.update(self.slabs.ops())  # reserve, put: one round trip per put
        self._full: tuple | None = None  # (valid until, hard-pinned count, their bytes, young bytes): _full_reason
        self._evictable_at = 0.0  # before this master-clock time no object is evictable (place)

    def handle(self, op: str, entries, opts, defer: bool = False, caller: str = ""):
        """Run one batch op; returns its payload. ``entries``/``opts``: as ``self.schemas`` decoded them (the RPC
        server), or plain Python values (a dict ``opts``), which are validated here first. ``caller``: the
        requester's named credential (role:name; "" for the cluster secret and in-process callers), whose share
        master/quotas.py bounds. Raises ValueError
        for an unknown op or an invalid request (naming the field); nothing is applied then. An admin scan
        (remove_by_regex, remove_all) or a data batch of more than batches.SLICE_KEYS entries runs to its end,
        or with ``defer`` is returned as a batches.Deferred for the caller to advance with ``step`` between
        other work (no other client waits on it)."""
        if type(opts) is dict:
            entries, opts = self.schemas.convert(op, entries, opts)
        if op in batches.SLICED and len(entries) > batches.SLICE_KEYS:
            out = batches.Sliced(functools.partial(self._run, caller=caller), op, entries, opts)
        else:
            out = self._run(op, entries, opts, self.clock(), caller)
        if not defer and isinstance(out, batches.Deferred):
            return out.run(self.clock())
        return out

    def _run(self, op: str, entries, opts, now: float, caller: str = ""):
        self.caller = caller
        if self.shard is not None and op in SHARD_ROUTED:  # only this shard's keys are put here
            return self.shard.route(op, entries, opts, lambda e, o: self._ops[op](e, o, now))
        return self._ops[op](entries, opts, now)

    def serve_native(self, body: bytes, ops: int) -> tuple[bytes, str] | None:
        """A get, exists or slab put request body answered in one native pass (metadata.ObjectTable.serve: the
        answers of op_get / op_exists, counted the same; a put as slabs.py op_put applies it), as (reply body,
        op); None where the Python path must answer it: another op or option, a key that is not ASCII, a batch
        over FRONT_MAX_KEYS, an object with several replicas or only on disk, any segment suspect (liveness.py),
        a put on a shard's master (shard.py routes it) or one that is not every entry back to back in one live
        slab, new keys. ``ops``: the metadata.FRONT_* bits the caller may run."""
        if self.segments.suspect:
            return None
        if self.shard is not None:
            ops &= ~FRONT_PUT
        now = self.clock()
        served = self.table.serve(body, now, ops, *self._front_limits)
        if served is None:
            return None
        reply, op, keys, hits = served
        if op == FRONT_GET:
            self.counters["hits"] += hits
            self.counters["misses"] += keys - hits
            return reply, "get"
        if op == FRONT_PUT:
            reply = self.slabs.serve_put(reply, hits, keys, now)
            return None if reply is None else (reply, "put")
        self.counters["lookup_keys"] += keys
        self.counters["lookup_hits"] += hits
        return reply, "exists"

    def step(self, op: batches.Deferred) -> bool:
        """Advance a deferred op by one slice; True once ``op.result`` is its payload."""
        return op.step(self.clock())

    # ---- objects -------------------------------------------------------------------------------------
    def op_put_start(self, entries, opts, now):
        """entries [(key, size)]; opts schema.PutStartOpts (store/placement.py PutConfig.wire). Per entry
        [OK, locations], [EXISTS, "complete"] (already stored: the put is a no-op), [PENDING, why] (another
        writer's put of the key has not committed: nothing allocated, retry) or [STORE_FULL, why] (no space, or
        max_pending_puts puts are pending: the entries past it)."""
        if opts.pin == 1 and opts.pin_ttl_ms <= 0:
            raise ValueError(f"a soft pin (pin=1) needs pin_ttl_ms > 0, got {opts.pin_ttl_ms}")
        room = self.cfg.max_pending_puts - self.table.pending_count()
        if room < len(entries):
            why = (
                f"{self.cfg.max_pending_puts - max(room, 0)} puts are pending (started, not yet committed), the "
                "master's max_pending_puts: retry once writers commit or their puts time out (put_timeout_ms)"
            )
        else:
            room, why = self.quotas.room(self.caller, [size for _, size in entries])
        if why is not None:  # the first ``room`` entries are placed, the rest refused (StoreFull)
            k = max(room, 0)
            return refuse(self.op_put_start(entries[:k], opts, now) if k else [], k, len(entries), why)
        replicas, preferred = opts.replicas, opts.segment
        pin = (opts.pin, now + opts.pin_ttl_ms / 1000 if opts.pin else 0.0)
        order = self.segments.by_free_space()  # once per batch, most free bytes first; key j starts at j-th
        biggest = max((s.size for s in order), default=0)
        fast = [s for s in order if s.name == preferred] or order  # a preferred segment takes the batch
        out = (
            self._put_contiguous(entries, now, fast, pin)
            if replicas == 1 and order and len(entries) > 1
            else [None] * len(entries)
        )
        for j, e in enumerate(entries):
            if out[j] is None:
                turn = order[j % len(order) :] + order[: j % len(order)] if len(order) > 1 else order
                out[j] = self._put_one(e, replicas, now, placement.preferred_first(turn, preferred), biggest, pin)
        # a generator: the base Journal never walks it, so a master without HA pays nothing per key
        self.journal.pending(self.table.get(key) for (key, _), (code, _) in zip(entries, out) if code == OK)
        self.quotas.took(self.caller, entries, out)
        self.evict_watermarks(now, len(entries))
        return out

    def _put_contiguous(self, entries, now: float, order: list[Segment], pin: tuple[int, float]) -> list:
        """Single-replica batch fast path: the batch's new keys are cut into one consecutive chunk per segment
        (in ``order``), each chunk carved consecutively from one free block of its segment, so its bytes are
        contiguous there and the client's transfer coalesces them. Entries it does not place (invalid,
        existing, duplicate in the batch, or no block holds their chunk) stay None for the per-key path."""
        out: list = [None] * len(entries)
        fresh, seen = [], set()
        for j, (key, size) in enumerate(entries):
            if key not in seen and key not in self.table:
                seen.add(key)
                fresh.append((j, key, size))
        step = -(-len(fresh) // len(order)) if fresh else 1
        deadline = now + self.cfg.put_timeout_ms / 1000
        for c, seg in enumerate(order):
            chunk = fresh[c * step : (c + 1) * step]
            offsets = seg.allocator.alloc_many([size for _, _, size in chunk]) if chunk else None
            if offsets is None:
                continue
            name, region, new = seg.name, seg.region_id, self.table.new
            for (j, key, size), off in zip(chunk, offsets):
                new(key, size, [(name, off)], deadline=deadline, last_access=now, pin=pin[0], pin_until=pin[1])
                out[j] = [OK, [[name, region, off]]]
            self.counters["puts"] += len(chunk)
        return out

    def _put_one(self, entry, replicas: int, now: float, order: list[Segment], biggest: int, pin: tuple):
        key, size = entry
        obj = self.table.get(key)
        if obj is not None:
            self.counters["put_skipped"] += 1
            return [EXISTS, "complete"] if obj.complete else [PENDING, _pending_why(obj, now)]
        placed = self.place(size, replicas, now, order, biggest)
        if isinstance(placed, str):
            self.counters["put_full"] += 1
            return [STORE_FULL, placed]
        self.table.new(
            key,
            size,
            [(seg.name, off) for seg, off in placed],
            last_access=now,
            deadline=now + self.cfg.put_timeout_ms / 1000,
            pin=pin[0],
            pin_until=pin[1],
        )
        self.counters["puts"] += 1
        return [OK, [[seg.name, seg.region_id, off] for seg, off in placed]]

    def place(self, size: int, replicas: int, now: float, order: list[Segment], biggest: int):
        """Replica list [(Segment, offset)], evicting LRU objects on demand; or a reason string (StoreFull).
        ``order``: the segments to try, in that order; ``biggest``: the largest segment's size."""
        if not order and len(self.segments):
            return (
                f"every segment is suspect (silent past heartbeat_timeout_ms={self.cfg.heartbeat_timeout_ms}: "
                f"{sorted(self.segments.suspect)}); retry once its node answers, or add segments"
            )
        if not order:
            return "no segment is registered; start `kvplugins store` or `kvplugins up`"
        if -(-size // self.cfg.alloc_align) * self.cfg.alloc_align > biggest:
            return f"object of {size} bytes is larger than the largest segment ({biggest} bytes)"
        want = min(replicas, len(self.segments))  # a pool of fewer segments stores fewer copies
        if len(order) < want:
            return self._too_few_live(replicas, len(order))
        while True:
            placed = placement.try_place(size, want, order)
            if placed:
                return placed
            if self.free_due_zombies(now):  # space whose lease ended since the last sweep (tick_ms)
                continue
            # once a scan found nothing to evict, no key (of this op or a later one) scans again before the first
            # object leaves its grace or lease (at most RESCAN_MAX_S): the scan visits every object when all are
            # young (a full store under a steady write load), and per key it stalled the master
            victim = None
            if now >= self._evictable_at:
                victim = next(victims(self.table, now, self.grace_cutoff(now)), None)
                if victim is None:
                    soonest = next_evictable(self.table, now, now - self.grace_cutoff(now))
                    self._evictable_at = min(soonest, now + RESCAN_MAX_S)
            if victim is None:
                return self._full_reason(size, now)
            self.evict(victim, now, urgent=True)

    def _too_few_live(self, replicas: int, live: int) -> str:
        """StoreFull reason for a put whose ``replicas`` cannot go to distinct segments now because registered
        segments are suspect or not yet admitted: acknowledging fewer copies would let one host's fault lose it."""
        down = sorted(self.segments.suspect | self.segments.unadmitted)
        return (
            f"the put asks for replicas={replicas} on distinct segments but only {live} of the "
            f"{len(self.segments)} registered segments take placement now (suspect or not yet admitted: "
            f"{down[:8]}); retry once they answer (heartbeat_timeout_ms={self.cfg.heartbeat_timeout_ms}), or "
            "lower replicas"
        )

    def grace_cutoff(self, now: float) -> float:
        """Objects committed after this master-clock time are within the eviction grace: never victims."""
        grace = self.cfg.eviction_grace_ms if self.cfg.eviction_grace_ms >= 0 else self.cfg.lease_ttl_ms
        return now - grace / 1000

    def _full_reason(self, size: int, now: float) -> str:
        """Why nothing can be evicted for a put of ``size`` bytes: a StoreFull message naming what holds the
        space and when the zombies' part of it returns."""
        if self._full is None or now >= self._full[0]:  # counted once until the next scan may find a victim
            young = young_bytes(self.table, self.grace_cutoff(now))
            self._full = (max(now + 1e-6, self._evictable_at), *hard_pinned_bytes(self.table), young)
        _, n, held, young = self._full
        due = self.zombies.next_due()
        back = f", the first back in {max(0, (due - now) * 1000):.0f} ms" if due is not None else ""
        return (
            f"no space for {size} bytes: every stored object is leased, pending, hard-pinned or within the "
            f"eviction grace ({young} bytes committed in the last "
            f"{(now - self.grace_cutoff(now)) * 1000:.0f} ms, {n} hard-pinned objects of {held} bytes; "
            f"{self.zombies.total()} bytes of {len(self.zombies)} removed objects return when their "
            f"readers' leases end{back}); retry then, or add segments"
        )

    def op_put_commit(self, entries, opts, now):
        """opts.xxh3: [xxh3_64 of each entry's bytes] (optional; stored and returned by get). A key already
        committed answers OK when its stored checksum equals this commit's (the same commit sent again after its
        reply was lost, or the same bytes): the put is done; else EXPIRED."""
        out, done = [], []
        sums = opts.xxh3
        if sums is not None and len(sums) != len(entries):
            raise ValueError(f"put_commit: opts: xxh3 has {len(sums)} checksums for {len(entries)} keys")
        for j, key in enumerate(entries):
            obj = self.table.get(key)
            if obj is not None and obj.complete and _same_bytes(obj.checksum, sums, j):
                out.append([OK, None])  # this commit again, resent after a lost reply (follower.py)
                continue
            if obj is None or obj.complete:
                out.append([EXPIRED, "no pending put (reclaimed after put_timeout_ms, removed, or never started)"])
                continue
            if sums is not None:
                obj.checksum = sums[j]
            self.table.commit(obj, now)
            self.counters["commits"] += 1
            out.append([OK, None])
            done.append(obj)
        self.quotas.done(o.key for o in done)
        self.journal.committed(done)
        self.events.stored(done)
        return out

    def op_put_abort(self, entries, opts, now):
        out = []
        for key in entries:
            obj = self.table.get(key)
            if obj is None or obj.complete:
                out.append([NOT_FOUND, "no pending put"])
                continue
            self.drop(obj, now, free_at=now)  # the writer's transfer batch has returned: free at once
            self.counters["aborts"] += 1
            out.append([OK, None])
        return out

    def op_get(self, entries, opts, now):
        """Per key [OK, [size, locations, lease ms, checksum]], [NOT_FOUND, None] or the disk tier's answer. A hit's
        lease is raised to now + lease_ttl_ms. With opts {"cols": 1}, columns instead (a 128-key reply packs in a
        fraction of the time): [ttl ms, sizes (-1 = miss), segment names, their region ids, per key the index of
        its first replica's segment (-1 = miss), its offset, {key index: all locations} for keys with more than
        one replica, per key its xxh3_64 checksum (None = none), {key index: the tier's [ON_DISK, value]} for
        disk-resident objects (their size is -1 here; the client resolves them)]. The lookups run natively
        (metadata.ObjectTable.get_cols)."""
        ttl = self.cfg.lease_ttl_ms
        hits, sizes, names, regions, seg_idx, offs, more, sums, disk = self.table.get_cols(
            entries, now, now + ttl / 1000
        )
        more = [(j, o.locations) for j, o in more]
        if self.segments.suspect:  # replicas on silent segments are not handed out (liveness.py)
            (hits, sizes, names, regions, seg_idx, offs, more, sums, disk), gone = liveness.readable_cols(
                (hits, sizes, names, regions, seg_idx, offs, more, sums, disk), self.segments.suspect
            )
            disk = [*disk, *self._disk_fallback(entries, gone)]
        self.counters["hits"] += hits
        self.counters["misses"] += len(entries) - hits
        if opts.cols:
            return [
                ttl,
                sizes,
                names,
                regions,
                seg_idx,
                offs,
                dict(more),
                sums,
                self._disk_answers(disk, now, only_on_disk=True),
            ]
        out = [
            [NOT_FOUND, None] if k < 0 else [OK, [n, [[names[k], regions[k], off]], ttl, c]]
            for n, k, off, c in zip(sizes, seg_idx, offs, sums)
        ]
        for j, locations in more:
            out[j][1][1] = locations
        for j, answer in self._disk_answers(disk, now, only_on_disk=False).items():
            out[j] = answer
        return out

    def _disk_answers(self, disk, now: float, only_on_disk: bool) -> dict:
        """{key index: the tier's answer} for complete disk-resident objects (promoted on a hit); with
        ``only_on_disk`` just the [ON_DISK, value] ones (the column reply leaves the rest misses)."""
        out = {}
        for j, obj in disk:
            answer = self.tiering.get(obj, now)
            if answer[0] == ON_DISK or not only_on_disk:
                out[j] = answer
        return out

    def op_exists(self, entries, opts, now):
        """Per key: stored, complete and readable (a replica on a live segment or on the disk tier). Counted as
        lookups (lookup_keys asked, lookup_hits found): the hit ratio an engine's prefix lookup sees."""
        out = liveness.readable(self.table, entries, self.table.exists(entries), self.segments.suspect, self._on_disk)
        self.counters["lookup_keys"] += len(entries)
        self.counters["lookup_hits"] += sum(out)
        return out

    def op_exists_prefix(self, entries, opts, now):
        """How many leading keys op_exists answers True for."""
        n = self.table.exists_prefix(entries)
        if self.segments.suspect and n:
            ok = liveness.readable(self.table, entries[:n], [True] * n, self.segments.suspect, self._on_disk)
            n = ok.index(False) if False in ok else n
        self.counters["lookup_keys"] += len(entries)
        self.counters["lookup_hits"] += n
        return n

    def _on_disk(self, obj: Object) -> bool:
        """Whether ``obj`` has a disk copy on a node that is not suspect (a reader can promote it from there)."""
        c = self.tiering.copy(obj)
        return c is not None and c.segment not in self.segments.suspect

    def _disk_fallback(self, entries: list, gone: list[int]) -> list:
        """[(key index, Object)] of the keys in ``gone`` (every DRAM replica suspect) that have a disk copy on a
        live node: their get answers ON_DISK instead of a miss."""
        out = []
        for j in gone:
            obj = self.table.get(entries[j])
            if obj is not None and self._on_disk(obj):
                out.append((j, obj))
        return out

    def op_remove(self, entries, opts, now):
        out = []
        for key in entries:
            obj = self.table.get(key)
            if obj is None:
                out.append([NOT_FOUND, None])
                continue
            self.drop(obj, now)
            self.counters["removes"] += 1
            out.append([OK, None])
        return out

    def op_report_corrupt(self, entries, opts, now):
        """entries: [key, segment name, offset, checksum] of a replica whose bytes did not match ``checksum``.
        That replica is dropped (its space freed once the object's lease ends) and copied again from a good
        one (re-replication); an object left without a replica is removed. Stale reports (the key was re-put, the replica moved) are ignored: NOT_FOUND."""
        out = []
        for key, name, off, checksum in entries:
            obj = self.table.get(key)
            if obj is None or not obj.complete or obj.checksum != checksum or (name, off) not in obj.replicas:
                out.append([NOT_FOUND, None])
                continue
            self.counters["corrupt_replicas"] += 1
            log.warning("replica of %s on %s at %s is corrupt (checksum mismatch); dropped", key, name, off)
            if len(obj.replicas) > 1:  # copied again from a good one (repair.py)
                self.repairs.lost(obj, len(obj.replicas))
            self._drop_replica(obj, name, off, now)
            out.append([OK, None])
        return out

    def quarantine(self, name: str, start: int, end: int, until: float) -> int:
        """Hold the free bytes of [start, end) in segment ``name`` until ``until`` (master clock), then free
        them (HA recovery: space an old leader handed out that a writer may still land in). Returns the bytes
        held; 0 for an unknown segment or a range beyond it."""
        seg = self.segments.get(name)
        if seg is None or end > seg.size:
            return 0
        offsets = seg.allocator.claim(start, end)
        if offsets:
            self.zombies.add(until, [(seg, off) for off in offsets])
        return sum(seg.allocator.size_at(off) for off in offsets)

    def clear_replicas(self, obj: Object, segment: str, now: float) -> str:
        """Drop ``obj``'s replicas on segment ``segment`` (Mooncake's BatchReplicaClear with a segment name):
        their space is freed once the object's read lease ends; an object left without a replica is removed.
        Returns "cleared" (other replicas remain), "removed" or "elsewhere" (no replica on that segment)."""
        mine = [r for r in obj.replicas if r[0] == segment]
        if not mine:
            return "elsewhere"
        if len(mine) == len(obj.replicas):
            self.drop(obj, now)
            self.counters["removes"] += 1
            return "removed"
        obj.replicas = [r for r in obj.replicas if r[0] != segment]
        seg = self.segments.get(segment)
        if seg is not None:
            self.zombies.add(max(obj.lease_until, now), [(seg, off) for _, off in mine])
        self.journal.replicas_changed([obj])
        return "cleared"

    def _drop_replica(self, obj: Object, name: str, off: int, now: float) -> None:
        if len(obj.replicas) == 1:
            self.drop(obj, now, reason="corrupt")
            return
        obj.replicas = [r for r in obj.replicas if r != (name, off)]
        seg = self.segments.get(name)
        if seg is not None:
            self.zombies.add(max(obj.lease_until, now), [(seg, off)])
        self.journal.replicas_changed([obj])

    def evict(self, obj: Object, now: float, urgent: bool) -> None:
        """Eviction chose ``obj``: the disk tier takes it over (offload) or it is dropped."""
        self.counters["evictions"] += 1
        if not self.tiering.evict(obj, now, urgent):
            self.drop(obj, now, reason="evicted")

    def drop(self, obj: Object, now: float, free_at: float | None = None, reason: str = "removed") -> None:
        """Remove ``obj`` from the table; its space is freed now, or when its lease/put deadline ends.
        ``reason``: why, for the removal event of a committed object (evicted, removed, corrupt)."""
        self.tiering.dropped(obj, now)  # disk copy deleted, a tier flight cancelled, the tier's lease ended
        self.journal.removed([obj])  # a pending put too (journal.pending)
        if obj.complete:
            self.events.removed([obj], reason)
        else:
            self.quotas.done((obj.key,))
        if free_at is None:
            free_at = obj.lease_until if obj.complete else obj.deadline
        held = [(self.segments.get(n), off) for n, off in obj.replicas]
        self.table.remove(obj)  # the view is dead from here
        if free_at > now:  # zombies hold the Segment itself: a re-registered namesake is never touched
            self.zombies.add(free_at, held)
        else:
            _free(held)

    # ---- segments ------------------------------------------------------------------------------------
    def op_register_segment(self, entries, opts, now):
        """entries [(descriptor, region id, size)]; opts OwnerOpts. Per entry [OK, name], [EXISTS, why] (the live
        name belongs to another process), [STORE_FULL, why] (max_segments, 64 of this process, or
        max_segments_per_identity of the caller's credential),
        [UNREACHABLE, why] (the master's admission probe could not write and read it back: removed again) or
        [INVALID, why]. With a prober (the RPC server's) the answer is an admission.Admission, deferred until
        every probe ended."""
        out, owner, probes = [], owner_digest(opts.owner), {}
        for desc, region_id, size in entries:
            wire = desc.wire()
            same = self.segments.repeated(wire, region_id, size, owner)
            if same is not None:  # the same request again (resent after a timeout): keep it and its objects
                self.segments.heartbeat(same.name, now)
                out.append([OK, same.name])
                continue
            try:
                seg = self.segments.add(
                    wire,
                    region_id,
                    size,
                    now,
                    owner,
                    self.cfg.max_segments,
                    self.caller,
                    self.cfg.max_segments_per_identity,
                )
            except SegmentOwned as err:
                out.append([EXISTS, str(err)])
                continue
            except TooMany as err:
                out.append([STORE_FULL, str(err)])
                continue
            except Exception as err:  # noqa: BLE001 - any bad entry is answered, never crashes the master
                out.append([INVALID, f"bad segment entry: {err}"])
                continue
            self.table.set_region(seg.name, seg.region_id)
            self._lose_objects(seg.name, self.table.on_segment(seg.name))
            probe = self._probe(seg)
            if probe is not None:
                probes[len(out)] = probe
                out.append(None)
            else:
                out.append(self._admitted(seg, now))
        return admission.Admission(out, probes, self._probed) if probes else out

    def _probe(self, seg: Segment):
        """(seg, probe block offset, Future) of its admission probe, or None without a prober, or when the
        objects of its manifest leave no free byte (then the same process, probed when it registered first,
        comes back: admitted)."""
        if self.prober is None:
            return None
        block = liveness.free_block(seg, self.manifests.peek(seg), admission.PROBE_BYTES)  # never over them
        if block is None:
            log.warning("segment %s re-registered full of its manifest's objects: admitted unprobed", seg.name)
            return None
        self.segments.unadmitted.add(seg.name)
        return seg, block[0], self.prober.submit(seg.descriptor, seg.region_id, *block)

    def _probed(self, seg: Segment, offset: int, why: str | None) -> list:
        """Register_segment's answer for ``seg`` once its probe ended (``why``: None when it succeeded)."""
        if self.segments.get(seg.name) is not seg:  # unregistered or replaced meanwhile
            return [NOT_FOUND, f"segment {seg.name} left while its admission probe ran"]
        seg.allocator.free(offset)
        self.segments.unadmitted.discard(seg.name)
        if why is None:
            return self._admitted(seg, self.clock())
        self.counters["segments_refused"] += 1
        self.segments.pop(seg.name)  # never admitted: nothing was placed on it or journaled (not "lost")
        log.warning("segment %s refused: the master could not write and read it back: %s", seg.name, why)
        return [
            UNREACHABLE,
            f"the master could not write and read back segment {seg.name} (admission probe): "
            f"{why}; check that its transports' advertised addresses (--host) are reachable "
            "from the master's host",
        ]

    def _admitted(self, seg: Segment, now: float) -> list:
        self.journal.segment_added(seg)
        self._restore(seg, now)
        log.info("segment %s registered: %d bytes from host %s", seg.name, seg.size, seg.descriptor.get("host_id"))
        return [OK, seg.name]

    def op_heartbeat(self, entries, opts, now):
        return [[OK, None] if self.segments.heartbeat(n, now) else [NOT_FOUND, None] for n in entries]

    def op_unregister(self, entries, opts, now):
        """entries [segment name]; opts OwnerOpts (the token it was registered with). Per entry [OK, None],
        [NOT_FOUND, None] or [EXISTS, why] (registered by another process: kept)."""
        out, owner = [], owner_digest(opts.owner)
        for name in entries:
            seg = self.segments.get(name)
            try:
                self.segments.check_owner(name, owner, "unregister")
            except SegmentOwned as err:
                out.append([EXISTS, str(err)])
                continue
            out.append([NOT_FOUND, None] if seg is None else [OK, None])
            if seg is not None:
                self._remove_segment(seg, "unregistered")
        return out

    def op_describe(self, entries, opts, now):
        out = []
        for name in entries:
            seg = self.segments.get(name)
            out.append([NOT_FOUND, None] if seg is None else [OK, seg.descriptor])
        return out

    def _restore(self, seg: Segment, now: float) -> None:
        """Objects of the manifest ``seg``'s process left when it was removed for silence (liveness.py)."""
        entries = self.manifests.take(seg)
        if entries:
            back = liveness.restore(self.table, seg, entries, now)
            self.counters["objects_restored"] += len(back)
            # the restored objects' records never left the journal (segment_parked); a key put again meanwhile
            # has a record of its own (the new copy): only the records of keys in neither go
            self.journal.manifest_dropped(seg.name, [e[0] for e in entries if e[0] not in self.table], False)
            self.events.stored(back)

    def _manifest_dropped(self, name: str, entries: list) -> None:
        """Manifest ``name`` aged out or its name went to another process: its objects' records go."""
        gone = [e[0] for e in entries if e[0] not in self.table]  # a key stored again has a record of its own
        self.journal.manifest_dropped(name, gone, self.segments.get(name) is None)

    def _remove_segment(self, seg: Segment, why: str, now: float | None = None) -> None:
        """Remove ``seg``; with ``now`` (removed for silence) the objects it held last are kept in its manifest."""
        self.segments.pop(seg.name)
        park = now is not None and bool(seg.owner)  # its process may come back for the objects it held last
        lost = self.table.on_segment(seg.name)
        gone = self._lose_objects(seg.name, lost, park)
        if park and gone:
            self.journal.segment_parked(seg)
            self.manifests.keep(seg, gone, now)
        else:
            self.journal.segment_removed(seg.name)
        self.counters["segments_lost"] += 1
        level = logging.INFO if why == "unregistered" and not lost else logging.WARNING  # a clean stop is news
        log.log(level, "segment %s removed (%s); %d objects lost a replica", seg.name, why, len(lost))

    def _lose_objects(self, name: str, objs, park: bool = False) -> list[tuple]:
        """Drop replica ``name`` of ``objs``. Returns liveness.Manifests entries (key, size, offset, checksum,
        pin, pin_until) of the complete objects that lost their last replica with it and were removed; with
        ``park`` their journal records stay (the segment's manifest, Journal.segment_parked)."""
        changed, gone, entries = [], [], []
        for obj in objs:
            held = obj.replicas
            obj.replicas = [(n, o) for n, o in held if n != name]
            if obj.replicas and obj.complete:  # a second replica lives on: copy it again elsewhere
                self.repairs.lost(obj, len(held))
            if obj.replicas or self.tiering.keeps(obj):  # (kept: it lives on in a node's disk)
                changed.append(obj)
                continue
            self.counters["objects_lost"] += 1
            gone.append(obj)
            if obj.complete:
                entries += [
                    (obj.key, obj.size, off, obj.checksum, obj.pin, obj.pin_until) for n, off in held if n == name
                ]
        done = [o for o in changed if o.complete]
        if any(o.replicas for o in done):  # their records are rewritten over the next turns (Journal.replicas_lost)
            self.journal.replicas_lost([o for o in done if o.replicas], name)
        if not all(o.replicas for o in done):  # on disk only: a record naming just a removed segment reads as lost
            self.journal.replicas_changed([o for o in done if not o.replicas])
        if len(done) < len(changed):
            self.journal.pending([o for o in changed if not o.complete])
        if gone:  # their records are deleted over the next turns (Journal.records_gone)
            self.journal.records_gone([o.key for o in gone if not (park and o.complete)], [name])
        done = [o for o in gone if o.complete]
        if done:
            self.events.removed(done, "lost")
        self.quotas.done(o.key for o in gone if not o.complete)
        for obj in gone:
            self.table.remove(obj)
        return entries

    # ---- sweep ---------------------------------------------------------------------------------------
    def tick(self) -> None:
        """Periodic sweep: dead segments, expired pending puts, due zombie frees, the disk tier, re-replication,
        watermark eviction, the shard's sweep. Every step runs even if an earlier one raised (a bug in one must not
        stop re-replication or eviction for good); the first error is raised after the last step (rpc_server
        logs it)."""
        now, errors = self.clock(), []
        for step in (
            self._sweep_segments,
            self.tiering.tick,
            self.repairs.tick,
            self.evict_watermarks,
            self._shard_tick,
        ):
            try:
                step(now)
            except Exception as e:  # noqa: BLE001 - re-raised below, once the other steps ran
                errors.append(e)
        if errors:
            raise errors[0]

    def _shard_tick(self, now: float) -> None:
        if self.shard is not None:
            self.shard.tick(self, now)

    def _sweep_segments(self, now: float) -> None:
        """Dead segments, expired pending puts, due zombie frees, slabs and soft pins."""
        timeout_s, grace_s = self.cfg.heartbeat_timeout_ms / 1000, self.cfg.suspect_grace_ms / 1000
        new, dead = self.segments.sweep(now, timeout_s, grace_s)
        self.counters["segments_suspect"] += len(new)
        for name in dead:
            self._remove_segment(
                self.segments.get(name),
                f"silent for {timeout_s + grace_s:g} s: heartbeat timeout and suspect grace",
                now,
            )
        self.manifests.tick(now)
        for obj in self.table.pending():
            if obj.deadline <= now:
                self.drop(obj, now, free_at=now)
                self.counters["reclaimed"] += 1
        self.free_due_zombies(now)
        self.slabs.tick(now)
        expire_soft_pins(self.table, now)

    def free_due_zombies(self, now: float) -> bool:
        """Free the removed objects whose lease (or put deadline) has run out; whether any were."""
        return self.zombies.free_due(now)

    def evict_watermarks(self, now: float, added: int = 0, touched: Segment | None = None) -> None:
        """Evict LRU objects of a segment above the high watermark until it is at the low one, after freeing the
        removed objects whose lease has ended. Space that removed objects still hold (zombies) is not counted:
        it returns by itself, and evicting live objects for it took the newest puts under churn (issue #18).
        At most EVICT_PER_CALL objects plus twice ``added`` (the objects the calling op stored) per call: a
        segment's descent to the low watermark goes on over the next ops and sweeps (``_draining``), so no op
        waits for a tenth of a segment's objects to be dropped (1,600 drops of 4 KiB objects, 25 ms, in a
        64 MiB segment; seconds in a 100 GiB one). ``touched``: the one segment the calling op stored into
        (a slab put), the only one it can have taken over the high watermark: the segments already draining
        and it are looked at, not every segment (the sweep, ``tick``, looks at all)."""
        self.free_due_zombies(now)
        high = self.cfg.high_watermark
        if touched is not None and not self._draining and not over_high(touched.used, touched.size, high):
            return  # its live bytes are at most its used bytes
        cutoff, budget = self.grace_cutoff(now), EVICT_PER_CALL + 2 * added
        if len(self._draining) > len(self.segments):  # segments removed while draining
            names = {s.name for s in self.segments}
            self._draining = {k: v for k, v in self._draining.items() if k in names}
        segments = self.segments if touched is None else self._watched(touched)
        for seg in segments:
            live = seg.used - self.zombies.held(seg.name)  # zombie space returns by itself: not a reason
            if seg.name not in self._draining:
                if not over_high(live, seg.size, high):
                    continue
                self._draining[seg.name] = now
            if self._draining[seg.name] > now:  # nothing evictable before then (below)
                continue
            excess, chosen = live - self.cfg.low_watermark * seg.size, []
            for obj in victims(self.table, now, cutoff, seg.name):  # choose first, drop after the lazy scan
                if excess <= 0 or len(chosen) == budget:
                    break
                chosen.append(obj)
                excess -= seg.allocator.rounded(obj.size)
            if excess <= 0:
                del self._draining[seg.name]
            elif not chosen:  # every object young, leased or hard-pinned: the scan visited them all for nothing
                soonest = next_evictable(self.table, now, now - cutoff, seg.name)
                self._draining[seg.name] = min(soonest, now + RESCAN_MAX_S)
            for obj in chosen:
                self.evict(obj, now, urgent=False)
            budget -= len(chosen)
            if budget <= 0:
                return

    def _watched(self, touched: Segment) -> list[Segment]:
        """``touched`` and the segments draining to their low watermark (evict_watermarks)."""
        draining = (self.segments.get(name) for name in self._draining if name != touched.name)
        return [touched, *(seg for seg in draining if seg is not None)]

    # ---- introspection -------------------------------------------------------------------------------
    def op_info(self, entries, opts, now):
        return {
            "version": VERSION,
            "zmq": self.zmq_endpoint,
            "events": self.events_endpoints[0],
            "events_replay": self.events_endpoints[1],
            "lease_ttl_ms": self.cfg.lease_ttl_ms,
            "put_timeout_ms": self.cfg.put_timeout_ms,
            "heartbeat_timeout_ms": self.cfg.heartbeat_timeout_ms,
        }

    def op_status(self, entries, opts, now):
        segs = [
            {
                "name": s.name,
                "host_id": s.descriptor.get("host_id", ""),
                "size": s.size,
                "used": s.used,
                "objects": self.table.count_on(s.name),
                "free_blocks": s.allocator.free_blocks(),
                "largest_free": s.allocator.largest_free(),
                "heartbeat_age_ms": int((now - s.last_heartbeat) * 1000),
                "suspect": s.name in self.segments.suspect,
                "identity": s.identity,
            }
            for s in self.segments
        ]
        return {
            "segments": segs,
            "objects": len(self.table),
            "manifest_objects": len(self.manifests),
            "repairs_queued": len(self.repairs),
            "pending": self.table.pending_count(),
            "pinned": self.table.pinned_count(),
            "zombies": len(self.zombies),
            "zombie_bytes": self.zombies.total(),
            "slabs": len(self.slabs),
            "identities": self.quotas.usage(),
            "bytes_used": sum(s["used"] for s in segs),
            "bytes_total": sum(s["size"] for s in segs),
            **self.counters,
            **self.tiering.status(),
        }


def _pending_why(obj: Object, now: float) -> str:
    return (
        f"another writer's put of this key has not committed yet (reclaimed in "
        f"{max(0.0, (obj.deadline - now) * 1000):.0f} ms if it never does); retry"
    )


def _free(held) -> None:
    for seg, off in held:
        if seg is not None:  # a lost segment took its space with it
            seg.allocator.free(off)


def _same_bytes(stored: int | None, sums, j: int) -> bool:
    """Whether a committed object's checksum ``stored`` is the one a put_commit names for entry ``j``."""
    return stored is not None and sums is not None and sums[j] == stored
