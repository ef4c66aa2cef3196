"""Host staging memory: one pool of equal slots, lent one per ``with pool.slot(...)`` block (issue #14, #33).

The transfer core moves bytes between registered host memory and its peers. Bytes that are not in registered
host memory go through a staging slot, and every such path uses this one pool:
* **bounce slots** of pages in device memory (GPU memory without GPUDirect RDMA; kvplugins/layout/staged.py):
  device -> slot -> store on a save, store -> slot -> device on a load. ``StagingPool(memory, nbytes,
  slot_bytes)`` over one host allocation the caller made (pinned), allocated once, so staging never allocates
  host memory per page or per batch and its size is the bound the operator sets; the caller registers
  ``regions()`` with its store client (which registers them again after every reconnect).
* **the bytes forms** of a store client (put/get of ``bytes``) and the disk tier's migrations:
  ``StagingPool.registered(engine, initial_bytes)``, one slot of memory the pool allocates and registers with
  ``engine`` itself and reallocates (doubling) when a call needs more: ``pool.slot(nbytes=n)``.

Lifecycle: construct -> ``with pool.slot(timeout_s, nbytes) as slot:`` (blocks while every slot is in use; a
batch larger than a fixed slot is moved in slot-sized chunks by the caller) -> ``close()``. Thread-safe: several
threads take slots concurrently; a slot is theirs alone until the ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import queue
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from kvplugins.errors import ConfigError, SlotsBusy

if TYPE_CHECKING:
    from kvplugins.transfer.api import Region
    from kvplugins.transfer.engine import TransferEngine


@dataclass(frozen=True)
class Slot:
    """``nbytes`` bytes of host memory at ``addr`` (index ``index`` of its pool)."""

    index: int
    addr: int
    nbytes: int


class StagingPool:
    """``nbytes`` of host memory at ``memory``'s address, cut into ``nbytes // slot_bytes`` slots.

    memory: the allocation, kept alive by the pool (anything with ``data_ptr()`` such as a pinned torch uint8
    tensor, or ``ctypes.data``: a numpy array). Raises ConfigError when not even one slot fits (the message
    names both sizes and the fix).
    """

    def __init__(self, memory: Any, nbytes: int, slot_bytes: int):
        if slot_bytes <= 0 or nbytes < slot_bytes:
            raise ConfigError(
                f"staging memory of {nbytes} B holds no slot of {slot_bytes} B; raise the bounce "
                f"size (bounce_bytes) to at least {max(slot_bytes, 1)} B"
            )
        self.slot_bytes = slot_bytes
        self._engine: TransferEngine | None = None
        self._region: Region | None = None
        self._set_memory(memory, nbytes // slot_bytes)
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(len(self.slots)):
            self._free.put(i)

    @classmethod
    def registered(cls, engine: "TransferEngine", initial_bytes: int) -> "StagingPool":
        """One slot of at least ``initial_bytes`` (and 4 KiB) of memory the pool allocates and registers with
        ``engine``; a ``slot(nbytes=...)`` call asking for more reallocates it (doubling)."""
        size = max(int(initial_bytes), 4096)
        pool = cls(np.empty(size, dtype=np.uint8), size, size)
        pool._engine = engine
        pool._region = engine.register(pool._memory)
        return pool

    def _set_memory(self, memory: Any, count: int) -> None:
        self._memory = memory
        addr = memory.data_ptr() if hasattr(memory, "data_ptr") else memory.ctypes.data
        self.slots = [Slot(i, addr + i * self.slot_bytes, self.slot_bytes) for i in range(count)]

    def regions(self) -> list[tuple[int, int]]:
        """The (address, nbytes) host range holding every slot: the memory to register for transfers."""
        return [(self.slots[0].addr, len(self.slots) * self.slot_bytes)]

    @contextlib.contextmanager
    def slot(self, timeout_s: float | None = None, nbytes: int = 0) -> Iterator[Slot]:
        """A free slot of at least ``nbytes`` for the ``with`` block (``timeout_s`` None: wait as long as it
        takes). Raises SlotsBusy (a TransferFailed) when none frees up in ``timeout_s`` (every slot held by transfers still
        running: the caller treats its pages as not moved), ValueError when ``nbytes`` exceeds a fixed slot."""
        try:
            i = self._free.get(timeout=timeout_s)
        except queue.Empty:
            raise SlotsBusy(
                f"no staging slot free within {timeout_s:g} s ({len(self.slots)} slots of "
                f"{self.slot_bytes} B all in use)"
            ) from None
        try:
            if nbytes > self.slot_bytes:
                self._grow(nbytes)
            yield self.slots[i]
        finally:
            self._free.put(i)

    def view(self, slot: Slot) -> memoryview:
        """A writable byte view of ``slot`` (pools over numpy memory, e.g. ``registered``)."""
        if not isinstance(self._memory, np.ndarray):
            raise TypeError("view() needs a pool over numpy memory; index the caller's own tensor instead")
        start = slot.index * self.slot_bytes
        return memoryview(self._memory[start : start + self.slot_bytes])

    def _grow(self, nbytes: int) -> None:
        """Reallocate the one slot of a ``registered`` pool (its caller holds that slot, so nobody uses it)."""
        if self._engine is None:
            raise ValueError(
                f"{nbytes} B do not fit a staging slot of {self.slot_bytes} B; move them in slot-sized chunks"
            )
        size = self.slot_bytes
        while size < nbytes:
            size *= 2
        if self._region is not None:
            self._engine.unregister(self._region)
        self.slot_bytes = size
        self._set_memory(np.empty(size, dtype=np.uint8), 1)
        self._region = self._engine.register(self._memory)

    def close(self) -> None:
        """Unregister memory the pool registered itself and drop its reference to the memory (the caller of
        the bounce form unregisters ``regions()`` first)."""
        if self._engine is not None and self._region is not None:
            with contextlib.suppress(queue.Empty):
                self._free.get(timeout=30)  # let a bytes call still running finish with the memory
            self._engine.unregister(self._region)
        self._region = self._memory = None
