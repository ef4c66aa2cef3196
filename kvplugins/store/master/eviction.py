"""Which objects may go, and in what order: least recently used complete objects without a live lease.

Two triggers (both in service.py): on demand inside put_start when nothing fits, and the watermark sweep —
a segment above ``high_watermark`` sheds objects with a replica on it until it is at or below ``low_watermark``.
Pending objects and objects under a live lease are never victims.
"""
from __future__ import annotations

from kvplugins.store.master.metadata import Object, ObjectTable


def evictable(obj: Object, now: float) -> bool:
    return obj.complete and not obj.leased(now)


def victims(table: ObjectTable, now: float, segment: str | None = None):
    """Evictable objects in LRU order; only those with a replica on ``segment`` if given. Lazy: the caller must
    stop iterating before it drops any (leased objects were touched recently, so they sit at the MRU end and the
    scan from the LRU end is short)."""
    for obj in table.iter_lru():
        if evictable(obj, now) and (segment is None or any(s == segment for s, _ in obj.replicas)):
            yield obj


def over_high(used: int, size: int, high: float) -> bool:
    return used > high * size
