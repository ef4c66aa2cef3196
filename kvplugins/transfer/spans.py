"""The array form of a batch: many spans between local memory and ONE remote region, as numpy arrays.

``TransferEngine.write_spans``/``read_spans`` take local addresses, remote offsets and lengths (uint64-able
arrays) instead of one TransferRequest object per entry, so a batch costs a few numpy calls rather than
Python work per entry. Spans that are contiguous on both sides (and in the same local region) are
coalesced into one before they reach a transport (a batch of consecutive pages becomes one copy / one
TCP entry); a coalesced span's status is the status of every span in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvplugins.errors import OutOfRange, TransferError
from kvplugins.transfer.api import Region, RegionInfo, SegmentDescriptor
from kvplugins.transfer.memory import RegionTable


SMALL = 8  # batches up to this many spans take the pure-Python path (numpy calls cost ~1 us each)


@dataclass
class SpanBatch:
    """Validated, coalesced spans to one remote region. ``addrs`` (local addresses), ``roffs`` (offsets in
    the remote region) and ``lens`` (bytes) are uint64 arrays of equal length, or Python int lists for a
    small batch (``as_list`` reads either); span j lies inside local region ``regions[j]``; ``pins`` keep
    the local memory mapped while the batch runs. ``digests``: set (uint64 array, one per span, spans not
    coalesced) when the caller wants each span's xxh3_64 and the transport hashes while it copies
    (``Transport.hashes_in_copy``); it fills them and sets ``hashed`` (the router hashes otherwise)."""

    remote: SegmentDescriptor
    info: RegionInfo
    addrs: np.ndarray
    roffs: np.ndarray
    lens: np.ndarray
    regions: list[Region]
    pins: list[Any]
    digests: np.ndarray | None = None
    hashed: bool = False

    def __len__(self) -> int:
        return len(self.lens)

    def subset(self, idx: list[int]) -> "SpanBatch":
        a, r, n = as_list(self.addrs), as_list(self.roffs), as_list(self.lens)
        return SpanBatch(
            self.remote,
            self.info,
            [a[i] for i in idx],
            [r[i] for i in idx],
            [n[i] for i in idx],
            [self.regions[i] for i in idx],
            self.pins,
            None if self.digests is None else np.zeros(len(idx), dtype=np.uint64),
        )

    def nbytes(self) -> int:
        return sum(self.lens) if isinstance(self.lens, list) else int(self.lens.sum())


def as_list(values) -> list[int]:
    """A SpanBatch field as a list of Python ints."""
    return values if isinstance(values, list) else values.tolist()


def small_lists(*seqs) -> list[list] | None:
    """The span sequences as lists when there are few enough for the pure-Python path (numpy arrays of integers
    become lists of ints), else None."""
    out = []
    for s in seqs:
        if type(s) is list and len(s) <= SMALL:
            out.append(s)
        elif isinstance(s, np.ndarray) and s.ndim == 1 and s.dtype.kind in "iu" and len(s) <= SMALL:
            out.append(s.tolist())
        else:
            return None
    return out


def prepare_small(
    regions: RegionTable,
    remote: SegmentDescriptor,
    info: RegionInfo,
    addrs: list,
    roffs: list,
    lens: list,
    readonly_ok: bool,
    status: list,
    coalesce: bool = True,
) -> tuple[SpanBatch | None, list, list]:
    """prepare() for a few spans given as int lists, without numpy; same results."""
    index = regions.index
    a_out, r_out, n_out, regs, valid, group = [], [], [], [], [], []
    for j, (a, r, n) in enumerate(zip(addrs, roffs, lens)):
        if type(a) is not int or type(r) is not int or type(n) is not int or min(a, r, n) < 0:
            raise OutOfRange(f"span {j}: address, offset and length must be integers >= 0, got {a!r}, {r!r}, {n!r}")
        reg = index.find(a, n) if n else None
        if r + n > info.length or (n and reg is None):
            status[j] = _span_error(remote, info, a, r, n)
            continue
        if not n:
            continue
        if not readonly_ok and reg.readonly:
            status[j] = OutOfRange(f"local region {reg.region_id} is read-only; read into writable memory")
            continue
        if coalesce and n_out and regs[-1] is reg and a_out[-1] + n_out[-1] == a and r_out[-1] + n_out[-1] == r:
            n_out[-1] += n
        else:
            a_out.append(a), r_out.append(r), n_out.append(n), regs.append(reg)
        valid.append(j)
        group.append(len(n_out) - 1)
    if not valid:
        return None, valid, group
    pins = [regions.pin(reg) for reg in {id(reg): reg for reg in regs}.values()]
    return SpanBatch(remote, info, a_out, r_out, n_out, regs, pins), valid, group


def as_u64(values, name: str) -> np.ndarray:
    """``values`` as a 1-D uint64 array. Raises OutOfRange for negative or non-integer values."""
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise OutOfRange(f"{name} must be a 1-D sequence of integers, got shape {arr.shape} dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise OutOfRange(f"{name} holds a negative value {int(arr.min())}; offsets and lengths are >= 0")
    return arr.astype(np.uint64, copy=False)


def prepare(
    regions: RegionTable,
    remote: SegmentDescriptor,
    info: RegionInfo,
    addrs,
    roffs,
    lens,
    readonly_ok: bool,
    status: list,
    coalesce: bool = True,
) -> tuple[SpanBatch | None, np.ndarray, np.ndarray]:
    """Validate spans; set ``status[j]`` (OutOfRange) for bad ones. Returns (batch of the valid non-empty spans,
    coalesced unless ``coalesce`` is False, or None; their original indices; the batch span of each of them)."""
    index = regions.index  # one snapshot for the whole batch
    local_idx, table = index.locate(addrs, lens), index.regions
    for j in np.flatnonzero((local_idx < 0) & (lens > 0)).tolist():  # overlapping registrations, or none
        reg = index.find(int(addrs[j]), int(lens[j]))
        if reg is not None:
            local_idx[j] = table.index(reg)
    size = np.uint64(info.length)
    bad_remote = (roffs > size) | (lens > size - np.minimum(roffs, size))  # no uint64 wrap
    for j in np.flatnonzero(((local_idx < 0) & (lens > 0)) | bad_remote).tolist():
        status[j] = _span_error(remote, info, int(addrs[j]), int(roffs[j]), int(lens[j]))
    valid = np.flatnonzero((local_idx >= 0) & ~bad_remote & (lens > 0))
    if not readonly_ok:
        ro = [j for j in valid.tolist() if table[local_idx[j]].readonly]
        for j in ro:
            status[j] = OutOfRange(
                f"local region {table[local_idx[j]].region_id} is read-only; read into writable memory"
            )
        if ro:
            valid = np.setdiff1d(valid, np.asarray(ro, dtype=np.int64))
    if not len(valid):
        return None, [], []
    a, r, n, li = addrs[valid], roffs[valid], lens[valid], local_idx[valid]
    starts = np.ones(len(valid), dtype=bool)
    if coalesce:
        starts[1:] = (a[1:] != a[:-1] + n[:-1]) | (r[1:] != r[:-1] + n[:-1]) | (li[1:] != li[:-1])
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    merged = np.add.reduceat(n, first) if len(first) < len(n) else n
    used = [table[i] for i in li[first].tolist()]
    pins = [regions.pin(reg) for reg in {id(reg): reg for reg in used}.values()]
    return (
        SpanBatch(remote, info, a[first], r[first], merged.astype(np.uint64), used, pins),
        valid.tolist(),
        group.tolist(),
    )


def _span_error(remote: SegmentDescriptor, info: RegionInfo, addr: int, roff: int, n: int) -> TransferError:
    if roff + n > info.length:
        return OutOfRange(
            f"remote region {info.region_id} of {remote.segment_id} (length {info.length}): "
            f"offset {roff} + length {n} is outside it"
        )
    return OutOfRange(f"local span [{addr:#x}, +{n}) lies in no registered region; register it first")
