"""Mooncake 0.3.13's ``BufferPool`` (also ``RegisteredBufferPool``): registered host memory for zero-copy
``put_from`` / ``get_into``, handed out as leases. What a caller sees was read off the real wheel (the crosscheck
runs tests/mooncake/test_mooncake_api.py's pool script there too); the memory management is ours.

Lifecycle, in call order:
  1. ``BufferPool(store, ...)``   ``store``: a MooncakeDistributedStore after ``setup`` (else RuntimeError).
  2. ``acquire(size)`` / ``buffer(size)``  a BufferLease of ``size`` bytes (>= 0): ``ptr`` (its address, registered
     with the store), ``size``, ``buffer`` (a writable memoryview); ``release()`` (idempotent) or a ``with`` block
     gives it back, as does dropping the last reference. A released lease's ``ptr`` and ``buffer`` raise
     RuntimeError ("buffer lease is closed"); its ``size`` stays readable.
  3. ``prewarm(size, count)``     make room for ``count`` leases of ``size`` bytes now (registration up front).
  4. ``close()``                  unregister every region; RuntimeError while leases are out.
Memory: regions of ``alignment`` bytes (more for a larger lease), each registered with the store once; leases are
carved first-fit in 512-byte granules and freed space is reused. Bounds: ``max_bytes`` (0: none) and
``max_regions`` (None: none) cap the regions, counted in whole regions; an acquire that does not fit waits for a
release when it may block (``block``, default ``block_on_exhaustion``) for up to ``timeout`` s (default
``default_timeout``; None: no limit), else raises RuntimeError naming the bound. ``min_size_class`` and
``max_size_class`` are accepted for compatibility (the 512-byte granule replaces size classes).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np

GRANULE = 512  # lease sizes round up to this (Mooncake packs a 1000-byte and a 64-byte lease 1 KiB apart)


class _Region:
    """``size`` registered bytes and their free extents [(offset, length)], sorted by offset."""

    def __init__(self, size: int):
        self.array = np.zeros(size, dtype=np.uint8)
        self.addr, self.size = int(self.array.ctypes.data), size
        self.free: list[tuple[int, int]] = [(0, size)]

    def carve(self, need: int) -> int | None:
        for i, (off, length) in enumerate(self.free):
            if length >= need:
                self.free[i : i + 1] = [(off + need, length - need)] if length > need else []
                return off
        return None

    def give_back(self, off: int, length: int) -> None:
        self.free.append((off, length))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self.free = merged


class BufferLease:
    """``size`` bytes of a BufferPool's registered memory at ``ptr``, until ``release()``."""

    def __init__(self, pool: "BufferPool", region: _Region, offset: int, size: int, length: int):
        self._region, self._offset, self._size = region, offset, size
        self._release = weakref.finalize(self, pool._give_back, region, offset, length)

    @property
    def ptr(self) -> int:
        self._check()
        return self._region.addr + self._offset

    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> memoryview:
        self._check()
        return memoryview(self._region.array[self._offset : self._offset + self._size])

    def release(self) -> None:
        self._release()

    def _check(self) -> None:
        if not self._release.alive:
            raise RuntimeError("buffer lease is closed")

    def __enter__(self) -> "BufferLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BufferPool:
    """Leases of registered memory for ``store`` (see the module docstring for the arguments)."""

    def __init__(
        self,
        store: Any,
        max_bytes: int = 0,
        min_size_class: int = 65536,
        max_size_class: int | None = None,
        alignment: int = 8 << 20,
        block_on_exhaustion: bool = True,
        default_timeout: float | None = None,
        max_regions: int | None = None,
        prewarm_size: int | None = None,
        prewarm_count: int = 0,
    ):
        if store is None or not hasattr(store, "health_check") or store.health_check() == 1:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if int(alignment) <= 0 or int(max_bytes) < 0:
            raise ValueError(f"alignment={alignment} must be > 0 and max_bytes={max_bytes} >= 0")
        self._store, self.alignment, self.max_bytes = store, int(alignment), int(max_bytes)
        self.max_regions = None if max_regions is None else int(max_regions)
        self.block_on_exhaustion, self.default_timeout = bool(block_on_exhaustion), default_timeout
        self.min_size_class, self.max_size_class = min_size_class, max_size_class
        self._regions: list[_Region] = []
        self._active = 0
        self._cond = threading.Condition()
        if prewarm_count and prewarm_size:
            self.prewarm(int(prewarm_size), int(prewarm_count))

    def acquire(self, size: int, block: bool | None = None, timeout: float | None = None) -> BufferLease:
        """A lease of ``size`` bytes (see the module docstring). Raises TypeError for a negative size, RuntimeError
        when the pool's bounds leave no room and it may not wait (or waited ``timeout`` s in vain)."""
        if not isinstance(size, int) or size < 0:
            raise TypeError(f"acquire(): size={size!r} must be an int >= 0")
        may_block = self.block_on_exhaustion if block is None else bool(block)
        wait = self.default_timeout if timeout is None else timeout
        deadline = None if wait is None else time.monotonic() + float(wait)
        need = max(GRANULE, -(-size // GRANULE) * GRANULE)
        with self._cond:
            while True:
                got = self._carve(need)
                if got is not None:
                    self._active += 1
                    return BufferLease(self, got[0], got[1], size, need)
                left = None if deadline is None else deadline - time.monotonic()
                if not may_block or (left is not None and left <= 0):
                    raise RuntimeError(
                        f"buffer pool exhausted: no room for {size} bytes within max_bytes="
                        f"{self.max_bytes} / max_regions={self.max_regions} ({len(self._regions)} "
                        f"regions of {self.alignment} B, {self._active} leases out); release "
                        "leases or raise the bounds"
                    )
                self._cond.wait(left)

    buffer = acquire

    def prewarm(self, size: int, count: int) -> None:
        """Carve ``count`` leases of ``size`` bytes and give them back: their regions are registered now."""
        leases = [self.acquire(size, block=False) for _ in range(count)]
        for lease in leases:
            lease.release()

    def close(self) -> None:
        """Unregister every region. RuntimeError while leases are out."""
        with self._cond:
            if self._active:
                raise RuntimeError("cannot close buffer pool with active leases")
            regions, self._regions = self._regions, []
        for region in regions:
            self._store.unregister_buffer(region.addr)

    def _carve(self, need: int) -> tuple[_Region, int] | None:
        for region in self._regions:
            off = region.carve(need)
            if off is not None:
                return region, off
        size = -(-need // self.alignment) * self.alignment
        used = sum(r.size for r in self._regions)
        if (
            self.max_bytes and self._regions and used + size > -(-self.max_bytes // self.alignment) * self.alignment
        ) or (self.max_regions is not None and len(self._regions) >= self.max_regions):
            return None
        region = _Region(size)
        if self._store.register_buffer(region.addr, size) != 0:
            raise RuntimeError(f"could not register {size} bytes of pool memory with the store")
        self._regions.append(region)
        off = region.carve(need)
        return (region, off) if off is not None else None

    def _give_back(self, region: _Region, offset: int, length: int) -> None:
        with self._cond:
            region.give_back(offset, length)
            self._active -= 1
            self._cond.notify_all()


RegisteredBufferPool = BufferPool
