"""The object table: key -> size, replicas, state (pending/complete), lease expiry, last access, checksum, pin.

The table is kept in LRU order (least recently used first): a commit or a get moves the key to the end,
so eviction (eviction.py) walks it from the front. Pinned objects (store/placement.py) live in a second LRU
of their own, so the eviction scan never walks past them. Times are master-clock seconds.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Object:
    key: str
    size: int                              # bytes, as put
    replicas: list[tuple[str, int]]        # (segment name, offset)
    complete: bool = False                 # False = pending: allocated, writer not yet committed
    deadline: float = 0.0                  # pending: reclaimed after this time
    lease_until: float = 0.0               # complete: never evicted/freed before this time
    last_access: float = 0.0
    locations: list | None = None          # cached [[segment, region id, offset], ...] for replies; None = stale
    checksum: int | None = None            # xxh3_64 of the bytes, from put_commit; None = not given
    pin: int = 0                           # 0 none, 1 soft (until pin_until), 2 hard (placement.PIN_CODES)
    pin_until: float = 0.0                 # soft pin: evicted last until this time
    born: float = 0.0                      # when it was committed: younger than the eviction grace, never evicted

    def leased(self, now: float) -> bool:
        return self.lease_until > now


class ObjectTable:
    def __init__(self):
        self._objects: OrderedDict[str, Object] = OrderedDict()   # unpinned, LRU first
        self._pinned: OrderedDict[str, Object] = OrderedDict()    # pin != 0, LRU first
        self._pending: dict[str, Object] = {}      # the not-yet-committed subset, for the reclaim sweep
        self._soft: list[tuple[float, str]] = []   # heap of (pin_until, key) of soft pins, for expiry
        self._parked: dict[str, Object] = {}       # in no LRU: disk-only objects (no DRAM to evict; tiering.py)

    def get(self, key: str) -> Object | None:
        obj = self._objects.get(key)
        if obj is None:
            if self._pinned:
                obj = self._pinned.get(key)
            if obj is None and self._parked:
                return self._parked.get(key)
        return obj

    def add(self, obj: Object) -> None:
        lru = self._pinned if obj.pin else self._objects
        lru[obj.key] = obj
        lru.move_to_end(obj.key)
        if obj.pin == 1:
            heapq.heappush(self._soft, (obj.pin_until, obj.key))
        if not obj.complete:
            self._pending[obj.key] = obj

    def commit(self, obj: Object, now: float) -> None:
        obj.complete, obj.born = True, now
        self._pending.pop(obj.key, None)
        self.touch(obj, now)

    def touch(self, obj: Object, now: float) -> None:
        obj.last_access = now
        (self._pinned if obj.pin else self._objects).move_to_end(obj.key)

    def unpin(self, obj: Object) -> None:
        """Make pinned ``obj`` a plain object, most recently used."""
        if self._pinned.pop(obj.key, None) is obj:
            self._objects[obj.key] = obj
        obj.pin = 0

    def expired_soft_pins(self, now: float) -> list[Object]:
        """Soft-pinned objects whose pin ended by ``now`` (each reported once)."""
        out = []
        while self._soft and self._soft[0][0] <= now:
            _, key = heapq.heappop(self._soft)
            obj = self._pinned.get(key)
            if obj is not None and obj.pin == 1 and obj.pin_until <= now:
                out.append(obj)
        return out

    def pop(self, key: str) -> Object | None:
        self._pending.pop(key, None)
        obj = self._objects.pop(key, None)
        if obj is None:
            obj = self._pinned.pop(key, None)
        return self._parked.pop(key, None) if obj is None else obj

    def park(self, obj: Object) -> None:
        """Take complete ``obj`` out of the LRU lists (eviction never scans it; get/pop still find it)."""
        self._objects.pop(obj.key, None)
        self._pinned.pop(obj.key, None)
        self._parked[obj.key] = obj

    def unpark(self, obj: Object, now: float) -> None:
        """Put parked ``obj`` back into its LRU list, most recently used."""
        if self._parked.pop(obj.key, None) is obj:
            (self._pinned if obj.pin else self._objects)[obj.key] = obj
            obj.last_access = now

    def lru(self):
        """Every object, unpinned ones least recently used first, then the pinned ones (a snapshot; safe to pop
        while iterating)."""
        return list(self._objects.values()) + list(self._pinned.values()) + list(self._parked.values())

    def iter_lru(self):
        """Unpinned objects, least recently used first, lazily: do not add or pop while iterating."""
        return iter(self._objects.values())

    def iter_lru_newest(self):
        """Unpinned objects, most recently used first, lazily."""
        return reversed(self._objects.values())

    def iter_pinned_newest(self):
        return reversed(self._pinned.values())

    def iter_pinned(self):
        """Pinned objects (soft and hard), least recently used first, lazily (as iter_lru)."""
        return iter(self._pinned.values())

    def pending(self) -> list[Object]:
        return list(self._pending.values())

    def pending_count(self) -> int:
        return len(self._pending)

    def pinned_count(self) -> int:
        return len(self._pinned)

    def __len__(self) -> int:
        return len(self._objects) + len(self._pinned) + len(self._parked)

    def __contains__(self, key: str) -> bool:
        return key in self._objects or key in self._pinned or key in self._parked
