"""A peer's batch as RDMA work requests, in arrays (one row per work request): the caller's spans coalesced where
they are contiguous on both sides in one local region, and cut at ``rdma_max_wr``. No Python object per span or
per work request: the rows go to the native post/poll call as they are (rdma_verbs.run), and a failed work
request maps back to the spans it covers by index.

``build(...)`` takes uint64 arrays of the caller's valid, non-empty spans (local address, remote address, length),
each span's row in a table of its local region's lkeys (one column per local NIC) and its remote region's rkeys
(one column per peer NIC).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Wrs:
    """Work requests to one peer. ``laddr``, ``raddr``, ``length`` (bytes; uint64), ``lkeys`` (n x local NICs),
    ``rkeys`` (n x peer NICs; uint64), and the caller's spans each covers: ``first``..``last`` inclusive (int64)."""

    laddr: np.ndarray
    raddr: np.ndarray
    length: np.ndarray
    lkeys: np.ndarray
    rkeys: np.ndarray
    first: np.ndarray
    last: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    def rows(self, sel: np.ndarray, local: int, remote: int) -> np.ndarray:
        """(laddr, lkey, raddr, rkey, length) rows of work requests ``sel`` over local NIC ``local`` and peer NIC
        ``remote``: what rdma_verbs.run posts."""
        return np.column_stack(
            (self.laddr[sel], self.lkeys[sel, local], self.raddr[sel], self.rkeys[sel, remote], self.length[sel])
        )


def build(
    laddr: np.ndarray,
    raddr: np.ndarray,
    length: np.ndarray,
    lkeys: np.ndarray,
    rkeys: np.ndarray,
    limit: int,
    coalesce: bool = True,
) -> Wrs:
    """Work requests for spans ``laddr``/``raddr``/``length`` (uint64, n, each > 0) whose lkeys and rkeys rows are
    ``lkeys`` (n x local NICs) and ``rkeys`` (n x peer NICs, or 1 x peer NICs for all): coalesced (unless not
    ``coalesce``) and cut at ``limit`` bytes."""
    n = len(length)
    rkeys = np.broadcast_to(rkeys, (n, rkeys.shape[1])) if len(rkeys) == 1 else rkeys
    first = np.arange(n, dtype=np.int64)
    if coalesce and n > 1:
        joins = (laddr[1:] == laddr[:-1] + length[:-1]) & (raddr[1:] == raddr[:-1] + length[:-1])
        joins &= (lkeys[1:] == lkeys[:-1]).all(axis=1) & (rkeys[1:] == rkeys[:-1]).all(axis=1)
        if joins.any():
            first = np.flatnonzero(np.concatenate(([True], ~joins)))
            length = np.add.reduceat(length, first).astype(np.uint64)
            laddr, raddr, lkeys, rkeys = laddr[first], raddr[first], lkeys[first], rkeys[first]
    last = np.append(first[1:], n) - 1
    return _cut(Wrs(laddr, raddr, length, lkeys, rkeys, first, last), limit)


def _cut(w: Wrs, limit: int) -> Wrs:
    """``w`` with each work request over ``limit`` bytes cut into pieces of at most ``limit``."""
    pieces = (w.length + np.uint64(limit - 1)) // np.uint64(limit)
    if not (pieces > 1).any():
        return w
    rep = np.repeat(np.arange(len(w), dtype=np.int64), pieces.astype(np.int64))
    starts = np.cumsum(pieces) - pieces
    off = (np.arange(len(rep), dtype=np.uint64) - np.repeat(starts, pieces.astype(np.int64))) * np.uint64(limit)
    length = np.minimum(np.uint64(limit), w.length[rep] - off)
    return Wrs(w.laddr[rep] + off, w.raddr[rep] + off, length, w.lkeys[rep], w.rkeys[rep], w.first[rep], w.last[rep])
