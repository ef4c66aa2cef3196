"""A peer's batch for the RDMA transport as columns: no Python object per span or per work request. The native call
(rdma_verbs.run_spans) cuts the spans into work requests of at most ``rdma_max_wr`` bytes, deals them over the
queue pairs and says which spans were not confirmed; a span maps back to the caller's entries by index.

A column is a uint64 numpy array (a big batch of the array path, TransferEngine.*_spans) or a list of ints (a
small one, and the TransferRequest path): in the soft-RoCE guest one numpy call costs more than the verbs of a
4 KiB read, so a small batch makes none. ``coalesce(...)`` builds the TransferRequest path's spans (entries
contiguous on both sides with the same keys joined); the array path's come coalesced by the router.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

Column = Union[list, np.ndarray]


@dataclass(frozen=True)
class Spans:
    """Columns ``laddr``, ``raddr``, ``length`` (bytes) of n spans; ``lkeys[i]``: their lkeys on local NIC i,
    ``rkeys[i]``: their rkeys on the peer's NIC i (each one per span, or one for all); ``first``/``last``: the
    caller's entries each span covers, inclusive (None: span j is the caller's entry j)."""

    laddr: Column
    raddr: Column
    length: Column
    lkeys: list[Column]
    rkeys: list[Column]
    first: Column | None = None
    last: Column | None = None

    def __len__(self) -> int:
        return len(self.length)

    def path(self, sel: list[int] | None, local: int, remote: int) -> tuple[Column, ...]:
        """(laddr, lkey, raddr, rkey, length) of spans ``sel`` (None: all) over local NIC ``local`` and the peer's
        NIC ``remote``: the columns rdma_verbs.run_spans takes."""
        lk, rk = self.lkeys[local], self.rkeys[remote]
        if sel is None:
            return self.laddr, lk, self.raddr, rk, self.length
        return _take(self.laddr, sel), _keys(lk, sel), _take(self.raddr, sel), _keys(rk, sel), _take(self.length, sel)

    def cut(self, limit: int) -> "Spans":
        """These spans with each over ``limit`` bytes cut into pieces of at most ``limit`` (so striping over several
        paths can share one big span's work requests), as arrays."""
        length = np.asarray(self.length, dtype=np.uint64)
        pieces = ((length + np.uint64(limit - 1)) // np.uint64(limit)).astype(np.int64)
        if not (pieces > 1).any():
            return self
        rep = np.repeat(np.arange(len(self), dtype=np.int64), pieces)
        off = (np.arange(len(rep), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)).astype(np.uint64)
        off *= np.uint64(limit)
        return Spans(
            _u64(self.laddr)[rep] + off,
            _u64(self.raddr)[rep] + off,
            np.minimum(np.uint64(limit), length[rep] - off),
            [_u64(k) if len(k) == 1 else _u64(k)[rep] for k in self.lkeys],
            [_u64(k) if len(k) == 1 else _u64(k)[rep] for k in self.rkeys],
            rep if self.first is None else np.asarray(self.first)[rep],
            rep if self.last is None else np.asarray(self.last)[rep],
        )

    def callers(self, spans: list[int]) -> list[int]:
        """The caller's entries that spans ``spans`` cover (each once, in order)."""
        first, last = self.first, self.last
        if first is None or last is None:
            return spans
        return sorted({k for j in spans for k in range(int(first[j]), int(last[j]) + 1)})


def coalesce(laddr: list[int], raddr: list[int], length: list[int], lkeys: list[tuple], rkeys: list[tuple]) -> Spans:
    """Spans from the caller's entries (one value per entry; ``lkeys``/``rkeys``: per entry, its key on each local
    / peer NIC), those contiguous on both sides with the same keys joined."""
    la, ra, ln, lk, rk, first, last = [], [], [], [], [], [], []
    for j, (a, r, n, lks, rks) in enumerate(zip(laddr, raddr, length, lkeys, rkeys)):
        if ln and la[-1] + ln[-1] == a and ra[-1] + ln[-1] == r and lk[-1] == lks and rk[-1] == rks:
            ln[-1] += n
            last[-1] = j
            continue
        la.append(a), ra.append(r), ln.append(n), lk.append(lks), rk.append(rks), first.append(j), last.append(j)
    return Spans(la, ra, ln, [list(c) for c in zip(*lk)], [list(c) for c in zip(*rk)], first, last)


def _take(col: Column, sel: list[int]) -> Column:
    return col[np.asarray(sel, dtype=np.int64)] if isinstance(col, np.ndarray) else [col[j] for j in sel]


def _keys(col: Column, sel: list[int]) -> Column:
    """``col`` at ``sel``, or ``col`` when it holds one key for all spans."""
    return col if len(col) == 1 else _take(col, sel)


def _u64(col: Column) -> np.ndarray:
    return np.asarray(col, dtype=np.uint64)
