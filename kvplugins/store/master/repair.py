"""Re-replication after a segment is lost (issue #34): an object that had N replicas and lost one with a removed
segment (its process silent past heartbeat_timeout_ms + suspect_grace_ms, or unregistered) gets a new replica on
another segment, so a second node death later does not take its last copy.

Lifecycle, in call order:
  ``lost(obj, had)`` (MasterService._lose_objects, for each complete object that still has a replica) queues the
  key with the replica count it had.
  ``tick(now)`` (the master's sweep) looks at the oldest queued keys and starts at most MAX_STARTS_PER_TICK
  copies: for each queued key whose object still has fewer replicas than it had and no copy or move task
  running, an internal ``copy`` task (replica_tasks.py: the process behind a surviving replica writes the bytes
  through the transfer core; not journaled) to the live segment holding none of its replicas with the most free bytes, on a host none of
  its replicas is on where there is one. A key
  leaves the queue when its object is whole again, removed or replaced; after MAX_ATTEMPTS tasks that did not
  make it whole (no room, no source with a command link, a failed write) it is given up and counted.
Counters: ``repairs_started`` (copy tasks created), ``repairs_given_up``; ``repairs_queued`` in the status.
A queued object's journal record carries the count it had (Journal.wanted, ha/journal.encode_object), so a new HA
leader queues it again (ha/recovery.py), as it does an object whose record names a segment it does not know.
"""

from __future__ import annotations

from collections import OrderedDict

from kvplugins.store.master.disk_state import Frozen
from kvplugins.store.master.placement import host_of
from kvplugins.store.wire.protocol import NOT_NOW, OK

MAX_STARTS_PER_TICK = 64  # copy tasks one sweep creates at most (each source node runs MAX_FLIGHTS at once)
MAX_EXAMINED_PER_TICK = 1024  # queued keys one sweep looks at (a sweep runs every tick_ms)
MAX_ATTEMPTS = 3  # copy tasks per key before it is given up
MAX_QUEUED = 1 << 20  # keys waiting; past it the oldest are given up


class Repairs:
    """The keys short of replicas, and the copy tasks that bring them back (see the module docstring)."""

    def __init__(self, service):
        self.service = service
        # key -> [object (a view of its table record: compared with ==), replicas it had, tasks started]
        self.queue: OrderedDict[str, list] = OrderedDict()

    def wanted(self, obj) -> int:
        """The replica count ``obj`` is queued to get back to, else 0."""
        entry = self.queue.get(obj.key)
        return entry[1] if entry is not None and entry[0] == obj else 0

    def lost(self, obj, had: int) -> None:
        """``obj`` (complete, still holding a replica) lost one of the ``had`` replicas it had."""
        entry = self.queue.get(obj.key)
        if entry is not None and entry[0] == obj:
            entry[1] = max(entry[1], had)
            return
        self.queue[obj.key] = [obj, had, 0]
        while len(self.queue) > MAX_QUEUED:
            self.queue.popitem(last=False)
            self.service.counters["repairs_given_up"] += 1

    def tick(self, now: float) -> None:
        """Look at up to MAX_EXAMINED_PER_TICK queued keys (oldest first; those still waiting go to the back) and
        start at most MAX_STARTS_PER_TICK copy tasks."""
        if not self.queue:
            return
        svc, tasks = self.service, self.service.tiering.tasks
        busy = {t.key for t in tasks.active.values()}
        started = 0
        for _ in range(min(len(self.queue), MAX_EXAMINED_PER_TICK)):
            if started >= MAX_STARTS_PER_TICK:
                return
            key, entry = self.queue.popitem(last=False)
            obj, had, attempts = entry
            if svc.table.get(key) != obj or not obj.complete or len(obj.replicas) >= had:
                continue  # whole again, removed or replaced
            if key not in busy and attempts >= MAX_ATTEMPTS:
                svc.counters["repairs_given_up"] += 1
                continue
            self.queue[key] = entry  # still short: to the back, whatever happens below
            target = None if key in busy else self._target(obj)
            if target is None:
                continue  # a task of the key runs, or no live segment can take it now
            code, _ = tasks.create("copy", key, "", [target], now, internal=True)
            entry[2] += 1
            if code == OK:
                started += 1
                svc.counters["repairs_started"] += 1
            elif code != NOT_NOW:
                del self.queue[key]
                svc.counters["repairs_given_up"] += 1

    def _target(self, obj) -> str | None:
        """The live segment for a new replica of ``obj``: none of its replicas there, room for it, a new host
        first, most free bytes first."""
        segs = self.service.segments
        held = {name for name, _ in obj.replicas}
        hosts = {host_of(s) for n in held if (s := segs.get(n)) is not None}
        fits = [
            s
            for s in segs.by_free_space()
            if s.name not in held and not isinstance(s.allocator, Frozen) and s.allocator.largest_free() >= obj.size
        ]
        for seg in fits:
            if host_of(seg) not in hosts:
                return seg.name
        return fits[0].name if fits else None

    def __len__(self) -> int:
        return len(self.queue)
