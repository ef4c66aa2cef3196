"""Turning (key, spans) plus master locations into transfer-core span arrays (gather on put, scatter on get).

A location is ``[segment name, region id, offset]``; the object's bytes are the concatenation of the spans, so
span j of a key lands at ``offset + sum(len of its spans before j)`` of every replica. Everything per span is
kept in numpy arrays (``Flat``) and each (segment, region) of a batch becomes ONE array-form transfer
(``TransferEngine.write_spans``/``read_spans``), so a batch costs numpy calls, not Python work per span.
A read uses the replica(s) it is given (client.py tries them in order).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from kvplugins.errors import BufferNotRegistered, StoreError, TransferFailed
from kvplugins.transfer.spans import SMALL


@dataclass
class Flat:
    """Every span of a batch: local address, bytes, owning key index, offset inside its object. numpy arrays
    (uint64; owner int64), or int lists when the batch has at most spans.SMALL spans."""

    addrs: np.ndarray | list
    lens: np.ndarray | list
    owner: np.ndarray | list
    inner: np.ndarray | list
    sizes: list[int]  # bytes per key (sum of its spans)
    nkeys: int


def flatten(engine, keys, spans_per_key, out) -> Flat:
    """The batch's spans as arrays. Sets ``out[i]`` to BufferNotRegistered for keys with a span outside
    registered memory (or a negative address/length). Raises StoreError if keys and span lists differ."""
    if len(keys) != len(spans_per_key):
        raise StoreError(f"{len(keys)} keys but {len(spans_per_key)} span lists; pass one span list per key")
    spans_per_key = [s if isinstance(s, (list, tuple)) else list(s) for s in spans_per_key]
    if all(len(spans) == 1 for spans in spans_per_key) and len(keys) > SMALL:  # the common page batch
        pairs = np.fromiter(
            itertools.chain.from_iterable(spans[0] for spans in spans_per_key), dtype=np.int64, count=2 * len(keys)
        )
        a, n = pairs[0::2].copy(), pairs[1::2].copy()
        return _checked(
            engine,
            keys,
            a,
            n,
            np.arange(len(keys), dtype=np.int64),
            np.zeros(len(keys), dtype=np.uint64),
            n.tolist(),
            out,
        )
    addrs, lens, owner, inner, sizes = [], [], [], [], []
    for i, spans in enumerate(spans_per_key):
        total = 0
        for addr, n in spans:
            addrs.append(addr)
            lens.append(n)
            owner.append(i)
            inner.append(total)
            total += n
        sizes.append(total)
    if len(lens) <= SMALL:
        return _flat_small(engine, keys, addrs, lens, owner, inner, sizes, out)
    return _checked(
        engine,
        keys,
        np.array(addrs, dtype=np.int64),
        np.array(lens, dtype=np.int64),
        np.array(owner, dtype=np.int64),
        np.array(inner, dtype=np.uint64),
        sizes,
        out,
    )


def _checked(engine, keys, a: np.ndarray, n: np.ndarray, own: np.ndarray, inner: np.ndarray, sizes: list, out) -> Flat:
    """Flat of int64 span arrays, marking keys with a negative or unregistered span BufferNotRegistered."""
    bad = (a < 0) | (n < 0)
    a, n = a.astype(np.uint64), n.astype(np.uint64)
    bad |= ~engine.spans_registered(np.where(bad, 0, a), np.where(bad, 0, n))
    if bad.any():
        for i in np.unique(own[bad]).tolist():
            if out[i] is None:
                out[i] = BufferNotRegistered(
                    f"{keys[i]}: a span lies in no registered region; call register_buffer on that memory first"
                )
    return Flat(a, n, own, inner, sizes, len(keys))


def _flat_small(engine, keys, addrs, lens, owner, inner, sizes, out) -> Flat:
    """flatten() for a few spans: plain int lists, region lookups by bisect (no numpy)."""
    addrs, lens = [int(a) for a in addrs], [int(n) for n in lens]
    for a, n, i in zip(addrs, lens, owner):
        if out[i] is not None or n == 0:
            continue
        try:
            if a < 0 or n < 0:
                raise BufferNotRegistered(f"span ({a}, {n}) has a negative address or length")
            engine.region_for(a, n)
        except BufferNotRegistered as e:
            out[i] = BufferNotRegistered(f"{keys[i]}: {e}; call register_buffer on that memory first")
    return Flat(addrs, lens, owner, inner, sizes, len(keys))


def reject_empty(keys, flat: Flat, out) -> None:
    """A put needs at least one byte: set ``out[i]`` for keys whose spans are empty."""
    for i, size in enumerate(flat.sizes):
        if out[i] is None and size <= 0:
            out[i] = StoreError(f"{keys[i]}: empty object; spans must hold at least 1 byte")


def groups(flat: Flat, todo: dict, descs: dict, failed: dict) -> list:
    """One (descriptor, region id, span indices, remote offsets) per (segment, region) the batch touches.
    ``todo``: key index -> locations to transfer. Keys naming an unknown segment go to ``failed``."""
    by_region: dict[tuple[str, int], list[int]] = {}  # per (segment, region): object offset per key or -1
    for i, locs in todo.items():
        for loc in locs:
            seg, region_id, offset = loc.segment, loc.region, loc.offset
            if seg not in descs:
                failed[i] = TransferFailed(f"segment {seg} is gone (node died or unregistered)")
                continue
            key_off = by_region.get((seg, region_id))
            if key_off is None:
                key_off = by_region[(seg, region_id)] = [-1] * flat.nkeys
            key_off[i] = offset
    if type(flat.lens) is list:
        return _groups_small(flat, by_region, descs, failed)
    out = []
    for (seg, region_id), offsets in by_region.items():
        key_off = np.array(offsets, dtype=np.int64)
        if failed:
            key_off[list(failed)] = -1
        _add_group(out, flat, descs[seg], int(region_id), key_off)
    return out


def _add_group(out: list, flat: Flat, desc, region_id: int, key_off: np.ndarray) -> None:
    """Append the group of spans whose key has an object offset (>= 0) in ``key_off`` (one per key)."""
    span_off = key_off[flat.owner]
    sel = np.flatnonzero((span_off >= 0) & (flat.lens > 0))
    if len(sel):
        out.append((desc, region_id, sel, span_off[sel].astype(np.uint64) + flat.inner[sel]))


def col_groups(flat: Flat, ok: np.ndarray, cols, descs: dict, failed: dict) -> list:
    """groups() from a column reply (``cols`` = segment names, region ids, per-key segment index, per-key
    offset) for the keys where ``ok`` (bool per key) holds; ``flat`` in array form."""
    names, regions, seg_idx, offs = cols
    out = []
    for k, name in enumerate(names):
        mask = ok & (seg_idx == k)
        if name not in descs:
            for i in np.flatnonzero(mask).tolist():
                failed[i] = TransferFailed(f"segment {name} is gone (node died or unregistered)")
        elif mask.any():
            _add_group(out, flat, descs[name], int(regions[k]), np.where(mask, offs, -1))
    return out


def arrays(flat: Flat) -> Flat:
    """``flat`` in array form (a small batch's lists converted)."""
    if type(flat.lens) is not list:
        return flat
    return Flat(
        np.array(flat.addrs, dtype=np.uint64),
        np.array(flat.lens, dtype=np.uint64),
        np.array(flat.owner, dtype=np.int64),
        np.array(flat.inner, dtype=np.uint64),
        flat.sizes,
        flat.nkeys,
    )


def _groups_small(flat: Flat, by_region: dict, descs: dict, failed: dict) -> list:
    out = []
    for (seg, region_id), key_off in by_region.items():
        sel, roffs = [], []
        for j, (i, n, inner) in enumerate(zip(flat.owner, flat.lens, flat.inner)):
            if n > 0 and key_off[i] >= 0 and i not in failed:
                sel.append(j)
                roffs.append(key_off[i] + inner)
        if sel:
            out.append((descs[seg], int(region_id), sel, roffs))
    return out


def pick(values, sel):
    """values[sel] for an array, [values[j] for j in sel] for a list."""
    return [values[j] for j in sel] if type(values) is list else values[sel]
