"""Space inside one segment: a first-fit free list with immediate coalescing.

Free blocks are kept sorted by offset (``bisect`` over a list of starts plus a dict start -> size).
``alloc`` scans in address order and takes the first block that fits (O(free blocks)); the remainder stays
free. ``free`` merges the block with its free neighbours at once, so two adjacent free blocks never exist.
Sizes are rounded up to ``align`` bytes (a power of two), so every offset is ``align``-aligned.
Fragmentation behaviour is documented in docs/store.md.
"""

from __future__ import annotations

import bisect

from kvplugins._meta import SizeMap


class Allocator:
    """Allocate [offset, offset+size) ranges inside ``capacity`` bytes. All sizes/offsets in bytes."""

    def __init__(self, capacity: int, align: int = 64):
        if capacity <= 0 or align <= 0 or align & (align - 1):
            raise ValueError(f"capacity={capacity} must be > 0 and align={align} a power of two")
        self.capacity, self.align = capacity, align
        self._starts: list[int] = [0]  # sorted starts of free blocks
        self._free: dict[int, int] = {0: capacity}
        self._used = SizeMap(align)  # offset -> rounded size of live allocations (native, 12 B/slot)
        self.used_bytes = 0

    def rounded(self, size: int) -> int:
        return (size + self.align - 1) & ~(self.align - 1)

    def alloc(self, size: int) -> int | None:
        """Offset of a new allocation of ``size`` bytes (> 0), or None if no free block fits."""
        need = self.rounded(size)
        start = self._carve(need)
        if start is not None:
            self._used[start] = need
        return start

    def alloc_many(self, sizes: list[int]) -> list[int] | None:
        """Offsets of one allocation per size, carved consecutively from the first free block that holds
        them all (so a batch lands contiguously), or None if no single block does (then use alloc())."""
        rounded = [(n + self.align - 1) & ~(self.align - 1) for n in sizes]
        off = self._carve(sum(rounded))
        if off is None:
            return None
        offsets, used = [], self._used
        for n in rounded:
            offsets.append(off)
            used[off] = n
            off += n
        return offsets

    def _carve(self, need: int) -> int | None:
        """Take ``need`` bytes from the front of the first free block that holds them; its start or None."""
        for i, start in enumerate(self._starts):
            have = self._free[start]
            if have >= need:
                del self._free[start]
                if have == need:
                    del self._starts[i]
                else:
                    self._starts[i] = start + need
                    self._free[start + need] = have - need
                self.used_bytes += need
                return start
        return None

    def claim(self, start: int, end: int) -> list[int]:
        """Allocate every free byte inside [start, end) (``align``-aligned bounds): the offsets of the new
        allocations, one per free run met, each freed on its own later. Used bytes grow by what was free."""
        out, i = [], max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self._starts) and self._starts[i] < end:
            s = self._starts[i]
            n = self._free[s]
            a, b = max(s, start), min(s + n, end)
            if a >= b:
                i += 1
                continue
            del self._free[s], self._starts[i]
            rest = [(s, a - s)] if a > s else []
            rest += [(b, s + n - b)] if s + n > b else []
            for k, (x, m) in enumerate(rest):
                self._free[x] = m
                self._starts.insert(i + k, x)
            self._used[a] = b - a
            self.used_bytes += b - a
            out.append(a)
            i += len(rest)
        return out

    def split(self, offset: int, at: int) -> None:
        """Cut the allocation at ``offset`` in two at ``at`` (offset < at < its end, ``align``-aligned): each
        part is then freed on its own. Used bytes do not change. Raises KeyError / ValueError otherwise."""
        size = self._used[offset]
        if not offset < at < offset + size or at & (self.align - 1):
            raise ValueError(f"split at {at}: not an aligned point strictly inside [{offset}, {offset + size})")
        self._used[offset], self._used[at] = at - offset, offset + size - at

    def split_run(self, front: int, sizes) -> int:
        """Cut the allocation at ``front`` into back-to-back allocations of ``sizes`` (aligned; a list or a uint64
        array) from its start, and what is left of it after them one more: split() once per piece, in one native
        pass. Returns where the pieces end. Raises KeyError (no allocation at ``front``) or ValueError (they pass
        its end; nothing cut)."""
        size = self._used[front]
        last = self._used.set_run(front, sizes, front + size)
        if last < front + size:
            self._used[last] = front + size - last
        return last

    def size_at(self, offset: int) -> int:
        """Rounded bytes of the allocation at ``offset``. Raises KeyError if not allocated."""
        return self._used[offset]

    def free(self, offset: int) -> None:
        """Return the allocation at ``offset``; merges with free neighbours. Raises KeyError if not allocated."""
        size = self._used.pop(offset)
        self.used_bytes -= size
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and offset + size == self._starts[i]:  # merge with the next block
            size += self._free.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and self._starts[i - 1] + self._free[self._starts[i - 1]] == offset:  # merge with previous
            self._free[self._starts[i - 1]] += size
            return
        self._starts.insert(i, offset)
        self._free[offset] = size

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def largest_free(self) -> int:
        return max(self._free.values(), default=0)

    def free_blocks(self) -> int:
        return len(self._starts)

    def fragmentation(self) -> float:
        """1 - largest free block / free bytes: 0 when all free space is one block."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free() / free


def reserve(alloc: Allocator, blocks: list) -> set:
    """Mark ``blocks`` [(offset, size, key)] allocated in the fresh allocator ``alloc``, using only its first-fit
    ``alloc``: gaps are filled with filler allocations (freed at the end), so each block lands at its own
    offset. Returns {(offset, key)} of the blocks that could not be placed (out of range, misaligned, or
    overlapping a block placed before it: of two that overlap, the one at the lower offset, then the smaller,
    then the lower key, keeps its bytes), so a dropped block never leaves space allocated. Used by HA recovery
    (ha/recovery.py) and a re-registered segment's manifest (liveness.py)."""
    bad, fillers, pos = set(), [], 0
    for off, size, key in sorted(blocks):
        if off < pos or off % alloc.align or off + alloc.rounded(size) > alloc.capacity:
            bad.add((off, key))
            continue
        if off > pos:
            fillers.append(alloc.alloc(off - pos))
        got = alloc.alloc(size)
        if got != off:  # not with first-fit from a fresh allocator; never overlap
            if got is not None:
                fillers.append(got)
            bad.add((off, key))
            continue
        pos = off + alloc.rounded(size)
    for f in fillers:
        alloc.free(f)
    return bad
