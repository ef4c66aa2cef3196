"""Per-instance caches and routing for ``kvplugins replay``, and the plain prefix-LRU the replay is checked against.

An instance's own cache is an LRU of blocks, as an engine's host cache (SGLang HiCache L2, vLLM's CPU offload)
keeps them. It lives in the replay process: it models what each engine holds for itself, in front of (or instead
of) the shared pool, which is always the real store.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict


class LocalLRU:
    """An LRU of at most ``capacity`` blocks."""

    def __init__(self, capacity: int):
        self.capacity, self._blocks = capacity, OrderedDict()

    def prefix(self, blocks, start: int = 0) -> int:
        """How many consecutive blocks from ``blocks[start]`` are held (no recency change)."""
        n = start
        while n < len(blocks) and blocks[n] in self._blocks:
            n += 1
        return n - start

    def admit(self, blocks) -> None:
        """The request's blocks are now the most recent, in order (hits touched, misses inserted); the least
        recent beyond capacity go."""
        od = self._blocks
        for b in blocks:
            od[b] = None
            od.move_to_end(b)
        while len(od) > self.capacity:
            od.popitem(last=False)

    def discard(self, blocks) -> None:
        """``blocks`` are no longer held (an engine evicted them)."""
        for b in blocks:
            self._blocks.pop(b, None)

    def clear(self) -> None:
        self._blocks.clear()

    def held(self) -> int:
        """Blocks held now."""
        return len(self._blocks)


class Router:
    """Picks the instance for each request: ``round_robin``; ``session`` (the request's session id, else its first
    4 blocks, hashed: a conversation's turns share their opening); ``prefix_aware`` (the instance whose local cache
    holds the longest prefix; ties go round robin)."""

    def __init__(self, policy: str, instances: int):
        self.policy, self.n, self._next = policy, instances, 0

    def pick(self, req, caches: list[LocalLRU] | None) -> int:
        rr = self._next % self.n
        self._next += 1
        if self.policy == "session":
            key = req.session if req.session is not None else repr(req.blocks[:4])
            return zlib.crc32(key.encode()) % self.n
        if self.policy == "prefix_aware" and caches:
            best = max(range(self.n), key=lambda i: (caches[i].prefix(req.blocks), -((i - rr) % self.n)))
            return best
        return rr


def reference_hit_ratio(requests, capacity: int, instances: int = 1) -> float:
    """Blocks hit / blocks looked up for a plain prefix-LRU of ``capacity`` blocks in all, split evenly over
    ``instances`` caches served round robin (no shared pool): the number the replay through the store is
    compared with (on the FAST'25 conversation trace: 0.287 at 20k blocks, 0.085 with 8 instances)."""
    caches = [LocalLRU(capacity // instances) for _ in range(instances)]
    hit = total = 0
    for i, r in enumerate(requests):
        c = caches[i % instances]
        hit += c.prefix(r.blocks)
        total += len(r.blocks)
        c.admit(r.blocks)
    return hit / total if total else 0.0
