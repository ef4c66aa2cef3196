"""Object checksums: xxh3_64 of an object's bytes (the digest of ``xxhash.xxh3_64_intdigest``), one digest per
object over the concatenation of its spans (batches.Flat), computed natively without copies.

The writer's digests come with the transfer itself where it can (``write_spans(..., digests=)``: the shm
transport hashes each span in its copy pass; other transports hash the local spans natively after the move),
and go to the master with put_commit; the master stores them (metadata.Object.checksum) and returns them with
every get; the reader gets the digests of the spans it read into the same way and compares (client.py). An
object of several spans is hashed natively over its spans (``native.hash_keys``). A checksum of None means
"not known" (never verified).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvplugins import native

HEAD_BYTES = 16  # how much of a mismatched object's read bytes a warning shows


def span_sums(flat) -> np.ndarray:
    """An empty per-span digest array for ``flat`` (uint64, one per span), for client._run_groups to fill."""
    return np.zeros(len(flat.lens), dtype=np.uint64)


def digests(flat, wanted, sums: np.ndarray | None = None) -> dict[int, int]:
    """key index -> xxh3_64 of the concatenation of its spans, for the key indices in ``wanted`` (a set or
    dict). ``sums``: per-span digests the transfer computed (span_sums); used as they are where every key has
    exactly one span, otherwise the wanted keys' spans (which must lie in registered memory: batches.flatten
    checked it) are hashed here."""
    if not len(wanted):
        return {}
    if sums is not None and _one_span_per_key(flat):
        return {i: int(sums[i]) for i in wanted}
    owner = np.asarray(flat.owner, dtype=np.int64)
    sel = np.flatnonzero(np.isin(owner, np.fromiter(wanted, dtype=np.int64, count=len(wanted))))
    got = native.hash_keys(
        np.asarray(flat.addrs, dtype=np.uint64)[sel],
        np.asarray(flat.lens, dtype=np.uint64)[sel],
        owner[sel],
        flat.nkeys,
    )
    return {i: int(got[i]) for i in wanted}


def _one_span_per_key(flat) -> bool:
    """Span i belongs to key i for every i (the page batch): then span digests are key digests."""
    owner = flat.owner
    if type(owner) is list:  # a small batch: no numpy round trip
        return owner == list(range(flat.nkeys))
    return len(owner) == flat.nkeys and bool((owner == np.arange(flat.nkeys)).all())


def mismatched(flat, expected: dict[int, int | None], sums: np.ndarray | None = None) -> list[int]:
    """Key indices whose spans do not hash to ``expected[i]`` (entries with None are not checked); ``sums`` as
    in digests()."""
    want = {i: s for i, s in expected.items() if s is not None}
    if not want:
        return []
    got = digests(flat, want, sums)
    return [i for i, s in want.items() if got[i] != s]


def head(flat, i: int) -> str:
    """The first HEAD_BYTES bytes (hex) read into key ``i``'s first span: a warning about a checksum mismatch
    shows them, so a fault run can tell whose bytes lie there (zeros, another object's, a torn write)."""
    owner = np.asarray(flat.owner, dtype=np.int64)
    j = int(np.flatnonzero(owner == i)[0])
    return ctypes.string_at(int(flat.addrs[j]), min(HEAD_BYTES, int(flat.lens[j]))).hex()
