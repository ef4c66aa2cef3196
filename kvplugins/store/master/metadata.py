"""The object table: key -> size, replicas, state (pending/complete), lease expiry, last access, checksum, pin.

The records live in native code (kvplugins._meta, native/src/meta: issue #18 part 2): one 80-byte record per
object plus its key bytes and an open-addressing index slot, about 160 bytes an object for 48-byte keys, where
a Python object per key cost about 600. ``Object`` is a view of one record: reading or writing its fields
reaches the record; once its key leaves the table (``remove``) every access raises RuntimeError, so a stale view
never reads another object's fields. Read what you need before removing.

Fields of an Object: key (str), size (bytes), replicas [(segment name, offset)], locations
[[segment, region id, offset]] (derived), complete (False = pending: allocated, writer not yet committed),
deadline (pending: reclaimed after), born (complete: when committed; younger than the eviction grace, never
evicted), lease_until (complete: never evicted/freed before), last_access, checksum (xxh3_64 or None), pin
(0 none, 1 soft until pin_until, 2 hard; placement.PIN_CODES). Times are master-clock seconds.

The table keeps LRU order (least recently used first): a commit or a get moves the key to the end, so eviction
(eviction.py) walks it from the front. Pinned objects live in a second LRU of their own, so the eviction scan
never walks past them; disk-only objects are parked in neither (tiering.py).
"""

from __future__ import annotations

import heapq

from kvplugins import _meta
from kvplugins._meta import Object

__all__ = ["Object", "ObjectTable"]
UNPINNED, PINNED, PARKED = _meta.UNPINNED, _meta.PINNED, _meta.PARKED


FRONT_GET, FRONT_EXISTS, FRONT_PUT = _meta.FRONT_GET, _meta.FRONT_EXISTS, _meta.FRONT_PUT  # serve's ops (serve.h)


class ObjectTable:
    def __init__(self):
        self._t = _meta.Table()
        self._soft: list[tuple[float, str]] = []  # heap of (pin_until, key) of soft pins, for expiry

    def get(self, key: str) -> Object | None:
        return self._t.get(key)

    def new(
        self,
        key: str,
        size: int,
        replicas,
        *,
        complete: bool = False,
        deadline: float = 0.0,
        born: float = 0.0,
        last_access: float = 0.0,
        pin: int = 0,
        pin_until: float = 0.0,
        checksum: int | None = None,
        lease_until: float = 0.0,
    ) -> Object:
        """Add an object (most recently used in its LRU). Raises KeyError if ``key`` is present."""
        obj = self._t.insert(
            key,
            size,
            replicas,
            complete,
            born if complete else deadline,
            last_access,
            pin,
            pin_until if pin == 1 else 0.0,
            checksum,
        )
        if lease_until:
            obj.lease_until = lease_until
        if pin == 1:
            heapq.heappush(self._soft, (pin_until, key))
        return obj

    def new_committed(self, key: str, size: int, replicas, now: float, checksum: int | None) -> Object:
        """new(key, size, replicas, complete=True, born=now, last_access=now, checksum=checksum) without the
        keyword handling: a slab put adds a batch of these (slabs.py)."""
        return self._t.insert(key, size, replicas, True, now, now, 0, 0.0, checksum)

    def insert_new(self, keys: list[str], sizes: list[int], segment: str, offsets: list[int], now: float, sums):
        """new_committed for a batch in one native pass: ``keys`` (none present, none repeated) at ``offsets`` of
        ``segment``, ``sums`` None or one checksum (or None) per key. Returns their Objects, or None with nothing
        changed where a key is present or repeats."""
        return self._t.insert_new(keys, sizes, segment, offsets, now, sums)

    def commit(self, obj: Object, now: float) -> None:
        """Pending ``obj`` becomes complete, born ``now``, most recently used."""
        self._t.commit(obj, now)

    def touch(self, obj: Object, now: float) -> None:
        self._t.touch(obj, now)

    def unpin(self, obj: Object) -> None:
        """Make pinned ``obj`` a plain object, most recently used (a parked one stays parked)."""
        self._t.set_pin(obj, 0)
        obj.pin_until = 0.0
        if obj.list == PINNED:
            self._t.link(obj, UNPINNED)

    def expired_soft_pins(self, now: float) -> list[Object]:
        """Soft-pinned objects whose pin ended by ``now`` (each reported once)."""
        out = []
        while self._soft and self._soft[0][0] <= now:
            _, key = heapq.heappop(self._soft)
            obj = self._t.get(key)
            if obj is not None and obj.pin == 1 and obj.pin_until <= now:
                out.append(obj)
        return out

    def remove(self, obj: Object) -> None:
        """Take ``obj`` out of the table; the view (and every other view of it) is dead after."""
        self._t.erase(obj)

    def park(self, obj: Object) -> None:
        """Take complete ``obj`` out of the LRU lists (eviction never scans it; get/remove still find it)."""
        self._t.link(obj, PARKED)

    def unpark(self, obj: Object, now: float) -> None:
        """Put parked ``obj`` back into its LRU list, most recently used."""
        if obj.list == PARKED:
            self._t.link(obj, PINNED if obj.pin else UNPINNED)
            obj.last_access = now

    # ---- batch lookups (native loops) ------------------------------------------------------------------
    def exists(self, keys: list) -> list[bool]:
        """Per key: stored and complete."""
        return self._t.exists(keys)

    def exists_prefix(self, keys: list) -> int:
        """How many leading ``keys`` are stored and complete."""
        return self._t.exists_prefix(keys)

    def get_cols(self, keys: list, now: float, lease_until: float):
        """Look up ``keys``; each complete one with a DRAM replica has its lease raised to ``lease_until`` and is
        touched. (hits, sizes (-1 = miss), segment names, their region ids, per key its first replica's segment
        index (-1 = miss), offset, [(j, Object)] with more replicas, per key checksum or None, [(j, Object)]
        complete but disk-only)."""
        return self._t.get_cols(keys, now, lease_until)

    def serve(self, body: bytes, now: float, ops: int, max_keys: int, max_key_bytes: int, ttl_ms: int):
        """A get or exists request body (wire/protocol.py) answered natively (native/src/meta/serve.h): (reply
        body, op (FRONT_GET or FRONT_EXISTS), keys, hits), or None, nothing changed, for the Python path. A
        slab put in its fast form (every entry in one slab, ASCII keys, opts {} or xxh3) comes back parsed but
        not applied: (the parsed put for commit_put, FRONT_PUT, keys, slab id). ``ops``: the FRONT_* bits the
        caller's role may run."""
        return self._t.serve(body, now, ops, max_keys, max_key_bytes, ttl_ms)

    def commit_put(self, put, segment: str, align: int, front: int, end: int, now: float, objects: bool):
        """Apply a put ``serve`` parsed into the slab whose unused part is [front, end) of ``segment`` (allocations
        rounded up to ``align`` bytes, a power of two), as insert_new: (reply body, allocation sizes as a uint64
        array (the objects lie back to back from ``front``), the new Objects if ``objects`` else None) when its
        entries lie back to back from ``front`` inside the slab and no key is present or repeats; None, nothing
        changed, otherwise. Raises ValueError for another ``align``."""
        return self._t.commit_put(put, segment, align, front, end, now, objects)

    def on_segment(self, name: str, limit: int = 0) -> list[Object]:
        """Objects with a replica on segment ``name``, at most ``limit`` (0: all); a native scan of the table
        that stops at the limit or once it found every replica counted there (none: no scan)."""
        return self._t.on_segment(name, limit)

    def count_on(self, name: str) -> int:
        """Replicas on segment ``name``."""
        return self._t.count_on(name)

    def set_region(self, name: str, region_id: int) -> None:
        """Segment ``name``'s region id, named in locations."""
        self._t.set_region(name, region_id)

    def nbytes(self) -> int:
        """Bytes the native table holds (records, index, keys, side maps)."""
        return self._t.nbytes()

    # ---- iteration -------------------------------------------------------------------------------------
    def lru(self) -> list[Object]:
        """Every object, unpinned ones least recently used first, then the pinned, then the parked ones (a
        snapshot; safe to remove while iterating)."""
        return [*self._t.iter(UNPINNED), *self._t.iter(PINNED), *self._t.iter(PARKED)]

    def iter_lru(self):
        """Unpinned objects, least recently used first, lazily: do not add or remove while iterating."""
        return self._t.iter(UNPINNED)

    def iter_lru_newest(self):
        """Unpinned objects, most recently used first, lazily."""
        return self._t.iter(UNPINNED, True)

    def iter_pinned_newest(self):
        return self._t.iter(PINNED, True)

    def iter_pinned(self):
        """Pinned objects (soft and hard), least recently used first, lazily (as iter_lru)."""
        return self._t.iter(PINNED)

    def pending(self) -> list[Object]:
        return self._t.pending()

    def pending_count(self) -> int:
        return self._t.pending_count()

    def pinned_count(self) -> int:
        return self._t.count(PINNED)

    def __len__(self) -> int:
        return len(self._t)

    def __contains__(self, key: str) -> bool:
        return key in self._t
