"""Local memory: turning buffers into (address, length) and the table of registered regions."""

from __future__ import annotations

import bisect
import ctypes
import itertools
import threading
from typing import Any

import numpy as np

from kvplugins.errors import BufferNotRegistered, OutOfRange
from kvplugins.transfer.api import DeviceMemory, Region
from kvplugins.transfer.shmem import Mapping


def buffer_span(mem: Any, length: int | None = None) -> tuple[int, int, Any, bool]:
    """(address, nbytes, keep-alive owner, readonly) of ``mem``.

    mem: a C-contiguous numpy array, a contiguous torch CPU tensor, any contiguous buffer (memoryview,
    bytearray, mmap) or an int address (then ``length`` is required). ``length`` (bytes) may cut the span
    shorter. Raises TypeError for other objects and OutOfRange for a bad length.
    """
    if isinstance(mem, bool):
        raise TypeError("register(True/False): pass a buffer or an int address with length=")
    if isinstance(mem, int):
        if length is None:
            raise TypeError(f"register({mem:#x}): an int address needs length= (bytes)")
        return mem, _check_length(length, None), None, False
    addr, nbytes, readonly = _torch_span(mem) if _is_torch(mem) else _buffer_span(mem)
    return addr, _check_length(nbytes if length is None else length, nbytes), mem, readonly


def _check_length(length: int, limit: int | None) -> int:
    if not isinstance(length, int) or length <= 0 or (limit is not None and length > limit):
        raise OutOfRange(f"length={length!r} invalid: use 1 .. {limit if limit is not None else 'size'} bytes")
    return length


def _is_torch(mem: Any) -> bool:
    return type(mem).__module__.startswith("torch") and hasattr(mem, "data_ptr")


def _torch_span(t: Any) -> tuple[int, int, bool]:
    if t.device.type != "cpu":
        raise TypeError(
            f"register(tensor on {t.device}): device memory is not registered by this build (a dmabuf "
            "MR for GPUDirect RDMA is not implemented); stage it through a registered host buffer"
        )
    if not t.is_contiguous():
        raise TypeError("register(tensor, contiguous=False): pass a contiguous CPU tensor (use .contiguous())")
    return int(t.data_ptr()), int(t.numel() * t.element_size()), False


def _buffer_span(mem: Any) -> tuple[int, int, bool]:
    if isinstance(mem, np.ndarray):
        if not mem.flags.c_contiguous:
            raise TypeError("register(numpy array): the array is not C-contiguous; use np.ascontiguousarray")
        return int(mem.ctypes.data), int(mem.nbytes), not mem.flags.writeable
    try:
        view = memoryview(mem)
    except TypeError:
        raise TypeError(
            f"register({type(mem).__name__}): pass a numpy array, torch CPU tensor, "
            "memoryview/bytearray or an int address with length="
        ) from None
    if not view.contiguous:
        raise TypeError("register(memoryview): the buffer is not contiguous")
    arr = np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view, dtype=np.uint8)
    return int(arr.ctypes.data), int(arr.nbytes), view.readonly


# PyMemoryView_FromMemory: a view over raw memory without creating a ctypes array type per length
# (``c_char * n`` costs ~10 us for each new n and caches every type forever).
_FROM_MEMORY = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi)
)
_PYBUF_WRITE = 0x200


def view_of(addr: int, length: int) -> memoryview:
    """A writable 1-D byte memoryview of ``length`` bytes at ``addr`` (the caller keeps the memory alive)."""
    return _FROM_MEMORY(addr, length, _PYBUF_WRITE)


class _Index:
    """An immutable snapshot of the regions sorted by address, for lock-free lookups by address:
    ``starts``/``ends`` as Python lists (bisect) and numpy uint64 arrays (searchsorted)."""

    def __init__(self, regions: list[Region]):
        self.regions = sorted(regions, key=lambda r: r.addr)
        self.starts = [r.addr for r in self.regions]
        self.ends = [r.addr + r.length for r in self.regions]
        self.max_ends = list(itertools.accumulate(self.ends, max))
        self.np_starts = np.array(self.starts, dtype=np.uint64)
        self.np_ends = np.array(self.ends, dtype=np.uint64)
        self.np_writable = np.array([not r.readonly for r in self.regions], dtype=bool)
        self.np_any = np.ones(len(self.regions), dtype=bool)

    def find(self, addr: int, length: int) -> Region | None:
        """A region holding [addr, addr+length) (the last-starting one where registrations overlap), or None."""
        i, end = bisect.bisect_right(self.starts, addr) - 1, addr + length
        while i >= 0 and self.max_ends[i] >= end:
            if self.ends[i] >= end:
                return self.regions[i]
            i -= 1
        return None

    def locate(self, addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Per span, the index (into ``regions``) of the last-starting region that starts at or before it,
        or -1 where that region does not hold the whole span (the caller falls back to find())."""
        idx = np.searchsorted(self.np_starts, addrs, side="right").astype(np.int64) - 1
        if not len(self.regions):
            return np.full(len(addrs), -1, dtype=np.int64)
        safe = np.maximum(idx, 0)
        ends = self.np_ends[safe]
        ok = (idx >= 0) & (addrs <= ends) & (lengths <= ends - np.minimum(addrs, ends))  # no uint64 wrap
        return np.where(ok, idx, -1)


class RegionTable:
    """Thread-safe table of this process's registered regions; ids are never reused. Lookups by address
    (find, locate) read an immutable sorted snapshot rebuilt on every add/remove, without the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._regions: dict[int, tuple[Region, Any]] = {}
        self._watchers: list[tuple[Any, Any]] = []
        self.index = _Index([])

    def watch(self, added, removed):
        """Call ``added(region, pin)`` for every exported region registered now and later, and ``removed(region)``
        when one goes (under the table's lock, so none is missed or reported twice). Returns the function that
        stops watching. The TCP server mirrors exported regions into its native table this way."""
        entry = (added, removed)
        with self._lock:
            self._watchers.append(entry)
            for region, owner in self._regions.values():
                if region.exported:
                    added(region, _pin(owner))

        def unwatch() -> None:
            with self._lock:
                if entry in self._watchers:
                    self._watchers.remove(entry)

        return unwatch

    def _reindex(self) -> None:  # device memory is not indexed: no local span may lie in it (stage it first)
        self.index = _Index([r for r, _ in self._regions.values() if r.device is None])

    def add(
        self,
        addr: int,
        length: int,
        owner: Any,
        shm_path: str | None = None,
        export: bool = False,
        readonly: bool = False,
        peer_readonly: bool = False,
        device: DeviceMemory | None = None,
    ) -> Region:
        with self._lock:
            region = Region(
                next(self._ids), addr, length, shm_path, bool(export), bool(readonly), bool(peer_readonly), device
            )
            self._regions[region.region_id] = (region, owner)
            self._reindex()
            if region.exported:
                for added, _ in self._watchers:
                    added(region, _pin(owner))
            return region

    def remove(self, region: Region) -> Any:
        """Drop ``region``; returns its owner. Raises BufferNotRegistered if it is not registered."""
        with self._lock:
            entry = self._regions.get(region.region_id)
            if entry is None or entry[0] != region:
                raise BufferNotRegistered(f"region {region.region_id} is not registered with this engine")
            del self._regions[region.region_id]
            self._reindex()
            if region.exported:
                for _, removed in self._watchers:
                    removed(region)
            return entry[1]

    def pin(self, region: Region) -> Any:
        """An object that keeps local ``region``'s memory mapped while held (even if it is unregistered
        meanwhile). Raises OutOfRange if ``region`` is not registered here."""
        with self._lock:
            entry = self._regions.get(region.region_id)
        if entry is None or entry[0] != region:
            raise OutOfRange(f"local region {region.region_id} is not registered with this engine")
        return _pin(entry[1])

    def find(self, addr: int, length: int) -> Region:
        """The registered region holding [addr, addr+length). Raises BufferNotRegistered."""
        region = self.index.find(addr, length)
        if region is not None:
            return region
        raise BufferNotRegistered(f"[{addr:#x}, +{length}) lies in no registered region; register the buffer first")

    def exported(self) -> list[Region]:
        with self._lock:
            return [r for r, _ in self._regions.values() if r.exported]

    def pop_all(self) -> list[Any]:
        with self._lock:
            owners = [o for _, o in self._regions.values()]
            for region, _ in self._regions.values():
                if region.exported:
                    for _, removed in self._watchers:
                        removed(region)
            self._regions.clear()
            self._reindex()
            return owners


def _pin(owner: Any) -> Any:
    if isinstance(owner, Mapping):
        arr = owner.array
        if arr is None:
            raise OutOfRange("region memory was already unmapped")
        return arr
    return owner


def span_addr(region: Region, offset: int, length: int, side: str) -> int:
    """Address of [offset, offset+length) inside ``region``. Raises OutOfRange naming ``side``."""
    if (
        not (isinstance(offset, int) and isinstance(length, int))
        or offset < 0
        or length < 0
        or offset + length > region.length
    ):
        raise OutOfRange(
            f"{side} region {region.region_id} (length {region.length}): "
            f"offset {offset} + length {length} is outside it"
        )
    return region.addr + offset
