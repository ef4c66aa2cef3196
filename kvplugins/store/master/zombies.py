"""Space that removed or evicted objects still hold: a reader's lease (or a writer's put deadline) may touch it,
so it is freed only when that ends. Eviction counts it as returning soon, not as used: a segment whose usage is
high only because of zombies evicts nothing (issue #18: counting it evicted the newest objects under churn)."""

from __future__ import annotations

import heapq


class Zombies:
    """A heap of (free_at, seq, [(Segment, offset)]) with the bytes each segment has waiting. Master-clock
    seconds. Holds the Segment objects, so a re-registered namesake is never touched."""

    def __init__(self):
        self._heap: list = []
        self._seq = 0
        self._bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, free_at: float, held: list) -> None:
        """``held`` [(Segment or None, offset)] is freed at ``free_at``."""
        self._seq += 1
        heapq.heappush(self._heap, (free_at, self._seq, held))
        for seg, off in held:
            if seg is not None:
                self._bytes[seg.name] = self._bytes.get(seg.name, 0) + seg.allocator.size_at(off)

    def free_due(self, now: float) -> bool:
        """Free every entry due by ``now``; whether any was."""
        freed = bool(self._heap) and self._heap[0][0] <= now
        while self._heap and self._heap[0][0] <= now:
            for seg, off in heapq.heappop(self._heap)[2]:
                if seg is not None:  # a lost segment took its space with it
                    self._bytes[seg.name] -= seg.allocator.size_at(off)
                    seg.allocator.free(off)
        return freed

    def held(self, segment: str) -> int:
        """Bytes of ``segment`` waiting to be freed."""
        return self._bytes.get(segment, 0)

    def total(self) -> int:
        return sum(self._bytes.values())

    def next_due(self) -> float | None:
        """When the next entry is freed (master-clock seconds), or None."""
        return self._heap[0][0] if self._heap else None
