"""Which objects may go, and in what order: least recently used complete objects without a live lease, then
soft-pinned ones (store/placement.py); hard-pinned objects never, nor objects committed within the eviction grace
(``MasterConfig.eviction_grace_ms``, default one lease TTL): under churn the sweep must not take the newest data,
so a put the client saw succeed is readable right after (issue #18).

Two triggers (both in service.py): on demand inside put_start when nothing fits, and the watermark sweep —
a segment above ``high_watermark`` sheds objects with a replica on it until it is at or below ``low_watermark``.
Pending objects and objects under a live lease are never victims. A soft pin whose TTL ended is turned into a
plain object by ``expire_soft_pins`` (the master's sweep).
"""

from __future__ import annotations

from kvplugins.store.master.metadata import Object, ObjectTable

SOFT, HARD = 1, 2


def evictable(obj: Object, now: float, born_before: float) -> bool:
    return obj.complete and not obj.leased(now) and obj.pin != HARD and obj.born <= born_before


def victims(table: ObjectTable, now: float, born_before: float, segment: str | None = None):
    """Evictable objects: unpinned ones in LRU order, then soft-pinned ones in LRU order; none committed after
    ``born_before`` (now - the grace); only those with a replica on ``segment`` if given. Lazy: the caller must
    stop iterating before it drops any (leased and young objects were touched recently, so they sit at the MRU
    end and the scan from the LRU end is short)."""
    for lru in (table.iter_lru, table.iter_pinned):
        for obj in lru():
            if evictable(obj, now, born_before) and (segment is None or any(s == segment for s, _ in obj.replicas)):
                yield obj


def next_evictable(table: ObjectTable, now: float, grace_s: float, segment: str | None = None) -> float:
    """The earliest master-clock time at which an object (with a replica on ``segment`` if given) that is not
    evictable at ``now`` becomes so by time alone (its grace and its lease both over); ``now + grace_s`` if none
    will (a put committed from now on is within the grace until then). Scans every object of the LRU lists once:
    for an eviction scan that found nothing, so it need not scan again before then."""
    soonest = now + grace_s
    for lru in (table.iter_lru, table.iter_pinned):
        for obj in lru():
            if obj.complete and obj.pin != HARD and (segment is None or any(s == segment for s, _ in obj.replicas)):
                soonest = min(soonest, max(obj.born + grace_s, obj.lease_until))
    return soonest


def young_bytes(table: ObjectTable, born_before: float) -> int:
    """Bytes of complete objects committed after ``born_before`` (named in a StoreFull message). Scans from the
    MRU end (LRU order is last-access order, and a commit is an access) and stops at the first object last used
    at or before ``born_before``: no object past it can be younger."""
    total = 0
    for lru in (table.iter_lru_newest, table.iter_pinned_newest):
        for obj in lru():
            if obj.last_access <= born_before:
                break
            if obj.complete and obj.born > born_before:
                total += obj.size
    return total


def expire_soft_pins(table: ObjectTable, now: float) -> int:
    """Unpin soft-pinned objects whose TTL ended; returns how many."""
    done = table.expired_soft_pins(now)
    for obj in done:
        table.unpin(obj)
    return len(done)


def hard_pinned_bytes(table: ObjectTable) -> tuple[int, int]:
    """(count, bytes) of hard-pinned objects: named in a StoreFull message."""
    objs = [o for o in table.iter_pinned() if o.pin == HARD]
    return len(objs), sum(o.size for o in objs)


def over_high(used: int, size: int, high: float) -> bool:
    return used > high * size
