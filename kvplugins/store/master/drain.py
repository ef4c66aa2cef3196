"""Draining a node (``kvplugins store --drain``): the master side.

``start`` freezes the segment's allocator (no new placements; disk_state.Frozen) and marks its node draining.
Each poll of that node (``plan``) moves up to MAX_FLIGHTS objects at a time: an object with another DRAM replica
just drops this one; any other object (in this segment's DRAM or only on the node's disk) gets a destination on
another segment, allocated like a put, and a ``migrate`` command: the node writes the bytes there through the
transfer core and confirms; ``migrated`` switches the replica (the old DRAM is freed one lease TTL later, so
readers that got the old location still read valid bytes). Pending puts are waited for. When nothing is left the
node is told to ``exit``: it unregisters and stops. Reads keep working throughout.
"""

from __future__ import annotations

from itertools import chain, islice

from kvplugins.store.master.disk_state import INF, MAX_FLIGHTS, Frozen
from kvplugins.store.wire.protocol import NOT_FOUND, OK


def start(tier, name: str, now: float):
    seg, node = tier.service.segments.get(name), tier.nodes.get(name)
    if seg is None or node is None:
        return [
            NOT_FOUND,
            f"{name} is not the segment of a running `kvplugins store` node or of a client contributing "
            "a segment; see `kvplugins status`",
        ]
    if not node.draining:
        node.draining = True
        seg.allocator = Frozen(seg.allocator)
        tier.counters["drains"] += 1
    return [OK, None]


def plan(tier, node, now: float) -> None:
    """Queue migrate commands for the draining ``node`` (or ``exit`` once it holds nothing). Looks at no more
    keys than it can start now (plus those in flight), so a poll costs O(MAX_FLIGHTS), not O(objects)."""
    svc = tier.service
    seg = svc.segments.get(node.segment)
    busy = tier.migrating(node.segment)
    if busy >= MAX_FLIGHTS:
        return
    want = len(tier.flights) + 4 * MAX_FLIGHTS
    in_dram = svc.table.on_segment(seg.name, want)  # a native scan of the table, stopping at ``want``
    disk_only = (k for k in node.keys if (o := svc.table.get(k)) is None or not o.on_segment(seg.name))
    keys = list(islice(chain((o.key for o in in_dram), disk_only), want))
    if not keys and not busy and not node.queue:
        node.queue.append(["exit"])
        return
    for key in keys:
        obj = svc.table.get(key)
        if obj is None:  # a stale entry (the object left without telling the tier)
            if key in node.keys:
                tier.forget_copy(key, delete=True)
            continue
        if not obj.complete or key in tier.flights:
            continue  # pending puts and flights are waited for
        if busy >= MAX_FLIGHTS:
            return
        if _drop_extra_replica(tier, obj, seg, now):
            continue
        elsewhere = obj.replicas or any(c.segment != seg.name for c in tier.copies_of(obj))
        if not any(n == seg.name for n, _ in obj.replicas) and elsewhere:
            tier.forget_copy(key, delete=True, segment=seg.name)  # DRAM or a disk copy lives elsewhere: this goes
            continue
        busy += _start_migration(tier, obj, node, seg, now)


def _drop_extra_replica(tier, obj, seg, now: float) -> bool:
    mine = [(n, o) for n, o in obj.replicas if n == seg.name]
    if not mine or len(obj.replicas) == 1:
        return False
    obj.replicas = [(n, o) for n, o in obj.replicas if n != seg.name]
    tier.free_at([(seg, mine[0][1])], max(now, obj.lease_until), now)
    tier.service.journal.replicas_changed([obj])
    return True


def _start_migration(tier, obj, node, seg, now: float) -> int:
    """1 if a migrate command was queued, 0 if no other segment can take ``obj`` now (retried next poll)."""
    svc = tier.service
    holders = {n for n, _ in obj.replicas}
    order = [
        s
        for s in svc.segments.by_free_space()
        if s.name not in holders and s.name != seg.name and not isinstance(s.allocator, Frozen)
    ]
    lease, obj.lease_until = obj.lease_until, INF  # on-demand eviction below must not pick obj itself
    placed = svc.place(obj.size, 1, now, order, max((s.size for s in order), default=0)) if order else None
    if not isinstance(placed, list):
        obj.lease_until = lease
        tier.counters["migrate_failures"] += 1
        return 0
    dest, off = placed[0]
    obj.lease_until = lease
    tier.migrate(obj, node.segment, dest, off, now)  # from its DRAM replica here, or from the node's disk
    return 1


def migrated(tier, key, segment: str, ok: bool, detail, now: float) -> None:
    """The node reports a migration; on success the object's replica moves to the destination."""
    f = tier.flight(key, "migrate", segment)
    if f is None:
        return
    svc, obj = tier.service, f.obj
    dest, off = f.dest
    if not ok or svc.segments.get(dest.name) is not dest:  # (a timed-out write may still land: a grace)
        tier.end_flight(key, now, free_dest_at=now + svc.cfg.put_timeout_ms / 1000)
        tier.counters["migrate_failures"] += 1
        if detail in ("corrupt", "missing"):
            tier.file_lost(key, segment, detail, now)
        return
    tier.end_flight(key, now)  # its destination becomes the replica
    seg = svc.segments.get(segment)
    old = [(seg, o) for n, o in obj.replicas if n == segment]
    if not obj.replicas:  # it was on disk only: back into the LRU
        svc.table.unpark(obj, now)
    obj.replicas = [(n, o) for n, o in obj.replicas if n != segment] + [(dest.name, off)]
    tier.free_at(old, max(now, obj.lease_until), now)  # readers that got the old location keep their lease
    tier.forget_copy(key, delete=True, segment=segment)
    svc.journal.replicas_changed([obj])
    tier.counters["migrations"] += 1
