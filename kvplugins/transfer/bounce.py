"""A bounded pool of host staging slots: the bounce memory of pages that live in device memory (issue #14).

The transfer core moves bytes between registered host memory and the store; memory it cannot register (GPU
memory without GPUDirect RDMA) goes through a bounce slot: device -> slot -> store on a save, store -> slot ->
device on a load (the device copies: kvplugins/layout/staged.py). The pool is one host allocation cut into
equal slots, allocated once, so staging never allocates host memory per page or per batch, and its size is
the bound the operator sets.

Lifecycle: ``BouncePool(memory, nbytes, slot_bytes)`` -> register ``regions()`` with the store client ->
``with pool.slot(timeout_s) as slot:`` (blocks while every slot is in use; a batch larger than a slot is moved
in slot-sized chunks by the caller) -> ``close()``. Thread-safe: several engine threads (load, save) take
slots concurrently; a slot is theirs alone until the ``with`` block ends.
"""
from __future__ import annotations

import contextlib
import queue
from dataclasses import dataclass
from typing import Any, Iterator

from kvplugins.errors import ConfigError, TransferFailed


@dataclass(frozen=True)
class Slot:
    """``nbytes`` bytes of host memory at ``addr`` (index ``index`` of its pool)."""
    index: int
    addr: int
    nbytes: int


class BouncePool:
    """``nbytes`` of host memory at ``memory``'s address, cut into ``nbytes // slot_bytes`` slots.

    memory: the allocation, kept alive by the pool (anything with ``data_ptr()`` such as a pinned torch uint8
    tensor, or ``ctypes.data``: a numpy array). Raises ConfigError when not even one slot fits (the message
    names both sizes and the fix).
    """

    def __init__(self, memory: Any, nbytes: int, slot_bytes: int):
        if slot_bytes <= 0 or nbytes < slot_bytes:
            raise ConfigError(f"bounce memory of {nbytes} B holds no slot of {slot_bytes} B; raise the bounce "
                              f"size (bounce_bytes) to at least {max(slot_bytes, 1)} B")
        self._memory = memory
        addr = memory.data_ptr() if hasattr(memory, "data_ptr") else memory.ctypes.data
        self.slot_bytes = slot_bytes
        self.slots = [Slot(i, addr + i * slot_bytes, slot_bytes) for i in range(nbytes // slot_bytes)]
        self._free: queue.Queue[Slot] = queue.Queue()
        for s in self.slots:
            self._free.put(s)

    def regions(self) -> list[tuple[int, int]]:
        """The (address, nbytes) host range holding every slot: the memory to register for transfers."""
        return [(self.slots[0].addr, len(self.slots) * self.slot_bytes)]

    @contextlib.contextmanager
    def slot(self, timeout_s: float) -> Iterator[Slot]:
        """A free slot for the ``with`` block. Raises TransferFailed when none frees up in ``timeout_s`` (every
        slot held by transfers still running: the caller treats its pages as not moved)."""
        try:
            s = self._free.get(timeout=timeout_s)
        except queue.Empty:
            raise TransferFailed(f"no bounce slot free within {timeout_s:g} s ({len(self.slots)} slots of "
                                 f"{self.slot_bytes} B all in use)") from None
        try:
            yield s
        finally:
            self._free.put(s)

    def close(self) -> None:
        """Drop the pool's reference to its memory (the caller unregisters it first)."""
        self._memory = None
