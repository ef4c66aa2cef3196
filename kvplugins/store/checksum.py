"""Object checksums: xxh3_64 (the ``xxhash`` package) of an object's bytes, hashed in place over its spans
(client_io.Flat) — no copy, one streaming hash per object when it has several spans.

The writer hashes its source spans and sends the digests with put_commit; the master stores them
(metadata.Object.checksum) and returns them with every get; the reader hashes the spans it read into and
compares (client.py). A checksum of None means "not known" (never verified).
"""
from __future__ import annotations

import xxhash

from kvplugins.transfer.memory import view_of


class _Views:
    """Zero-copy views of registered memory: one memoryview per registered region, sliced per span."""

    def __init__(self, engine):
        self.engine, self.start, self.end, self.view = engine, 1, 0, None

    def get(self, addr: int, n: int) -> memoryview:
        if not (self.start <= addr and addr + n <= self.end):
            region = self.engine.region_for(addr, n)
            self.start, self.end = region.addr, region.addr + region.length
            self.view = view_of(region.addr, region.length)
        return self.view[addr - self.start:addr - self.start + n]


def _lists(flat):
    if type(flat.lens) is list:
        return flat.addrs, flat.lens, flat.owner
    return flat.addrs.tolist(), flat.lens.tolist(), flat.owner.tolist()


def digests(engine, flat, wanted) -> dict[int, int]:
    """key index -> xxh3_64 of the concatenation of its spans, for the key indices in ``wanted`` (a set or
    dict). Every span must lie in registered memory (client_io.flatten checked it)."""
    addrs, lens, owner = _lists(flat)
    views, out = _Views(engine), dict.fromkeys(wanted, EMPTY)
    if owner == list(range(flat.nkeys)):  # exactly one span per key (the common page batch): one-shot digests
        for a, n, i in zip(addrs, lens, owner):
            if n and i in out:
                out[i] = xxhash.xxh3_64_intdigest(views.get(a, n))
        return out
    parts = {}
    for a, n, i in zip(addrs, lens, owner):
        if n and i in wanted:
            got = parts.get(i)
            if got is None:
                parts[i] = views.get(a, n)
            elif type(got) is list:
                got.append(views.get(a, n))
            else:
                parts[i] = [got, views.get(a, n)]
    for i, got in parts.items():
        out[i] = _digest(got) if type(got) is list else xxhash.xxh3_64_intdigest(got)
    return out


def _digest(views: list) -> int:
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def mismatched(engine, flat, expected: dict[int, int | None]) -> list[int]:
    """Key indices whose spans do not hash to ``expected[i]`` (entries with None are not checked)."""
    want = {i: s for i, s in expected.items() if s is not None}
    if not want:
        return []
    got = digests(engine, flat, want)
    return [i for i, s in want.items() if got.get(i, EMPTY) != s]


EMPTY = xxhash.xxh3_64_intdigest(b"")
