"""The object table: key -> size, replicas, state (pending/complete), lease expiry, last access.

The table is kept in LRU order (least recently used first): a commit or a get moves the key to the end,
so eviction (eviction.py) walks it from the front. Times are master-clock seconds.
"""
from __future__ import annotations

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

    def leased(self, now: float) -> bool:
        return self.lease_until > now


class ObjectTable:
    def __init__(self):
        self._objects: OrderedDict[str, Object] = OrderedDict()
        self._pending: dict[str, Object] = {}      # the not-yet-committed subset, for the reclaim sweep

    def get(self, key: str) -> Object | None:
        return self._objects.get(key)

    def add(self, obj: Object) -> None:
        self._objects[obj.key] = obj
        self._objects.move_to_end(obj.key)
        if not obj.complete:
            self._pending[obj.key] = obj

    def commit(self, obj: Object, now: float) -> None:
        obj.complete = True
        self._pending.pop(obj.key, None)
        self.touch(obj, now)

    def touch(self, obj: Object, now: float) -> None:
        obj.last_access = now
        self._objects.move_to_end(obj.key)

    def pop(self, key: str) -> Object | None:
        self._pending.pop(key, None)
        return self._objects.pop(key, None)

    def lru(self):
        """Objects, least recently used first (a snapshot; safe to pop while iterating)."""
        return list(self._objects.values())

    def iter_lru(self):
        """Objects, least recently used first, lazily: do not add or pop while iterating."""
        return iter(self._objects.values())

    def pending(self) -> list[Object]:
        return list(self._pending.values())

    def pending_count(self) -> int:
        return len(self._pending)

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: str) -> bool:
        return key in self._objects
