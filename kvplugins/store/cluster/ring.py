"""The key -> shard map of a sharded store: consistent hashing with virtual nodes (Karger et al. 1997; the
scheme of Dynamo §4.2). Each shard id owns ``VNODES`` points on a 64-bit ring (xxh3_64 of ``"{id}#{i}"``); a key
(xxh3_64 of its UTF-8 bytes) belongs to the shard of the first point at or after it, wrapping around. Adding or
removing a shard moves only the arcs that shard gains or loses (about 1/N of the keys).

Every process computes the same map from the same member set: clients route with it, masters check ownership
of puts with it, nodes do not need it (they spread capacity by shard count, shard/extents.py).
"""

from __future__ import annotations

import bisect
import operator

import numpy as np
import xxhash

from kvplugins import native

VNODES = 256  # points per shard: 3 shards, 100 k keys -> the largest share within ~1.1x of 1/3
_UTF8 = operator.methodcaller("encode", "utf-8", "surrogatepass")


def key_point(key: str) -> int:
    """The ring position of ``key`` (uint64)."""
    return xxhash.xxh3_64_intdigest(_UTF8(key))


class Ring:
    """An immutable map of keys to shard ids over ``members`` (ids, any order; may be empty)."""

    def __init__(self, members):
        self.members = tuple(sorted(members))
        pts = sorted((xxhash.xxh3_64_intdigest(f"{m}#{i}".encode()), m) for m in self.members for i in range(VNODES))
        self.points = np.array([p for p, _ in pts], dtype=np.uint64)  # ascending ring positions
        self._owner = [m for _, m in pts]
        index = {m: i for i, m in enumerate(self.members)}
        self.point_shard = np.array([index[m] for m in self._owner], dtype=np.uint32)  # point -> members index
        self._plist = self.points.tolist()

    def __eq__(self, other) -> bool:
        return isinstance(other, Ring) and other.members == self.members

    def __hash__(self) -> int:
        return hash(self.members)

    def owner(self, key: str) -> str | None:
        """The shard id owning ``key``; None for an empty ring."""
        if not self._owner:
            return None
        j = bisect.bisect_left(self._plist, key_point(key))
        return self._owner[j % len(self._owner)]

    def owners(self, keys) -> list[str | None]:
        """owner() of each key (one native pass for the batch: indices)."""
        if not self._owner:
            return [None] * len(keys)
        members = self.members
        return [members[j] for j in self.indices(keys).tolist()]

    def indices(self, keys) -> np.ndarray:
        """The index in ``members`` of each key's owner (uint32 array; the ring must not be empty): hashed and
        searched natively (native.ring_owners), or here for a key the native call refuses (not a str, or a str
        with lone surrogates, which hash as their "surrogatepass" UTF-8 bytes)."""
        keys = keys if isinstance(keys, list) else list(keys)
        try:
            return native.ring_owners(keys, self.points, self.point_shard, len(self.members))
        except TypeError:
            pts = np.fromiter(map(xxhash.xxh3_64_intdigest, map(_UTF8, keys)), dtype=np.uint64, count=len(keys))
            return self.point_shard[np.searchsorted(self.points, pts, side="left") % len(self.points)]

    def split(self, keys) -> dict[str | None, list[int]]:
        """Shard id -> indices of ``keys`` it owns, in order."""
        out: dict[str | None, list[int]] = {}
        for i, m in enumerate(self.owners(keys)):
            out.setdefault(m, []).append(i)
        return out

    def shares(self) -> dict[str, float]:
        """Fraction of the 64-bit key space each member owns."""
        if not self._owner:
            return {}
        span = np.diff(self.points.astype(np.float64), prepend=self.points[-1].astype(np.float64) - 2.0**64)
        out = dict.fromkeys(self.members, 0.0)
        for m, s in zip(self._owner, span.tolist()):
            out[m] += s / 2.0**64
        return out
