"""Liveness of segments (issue #30 item 7): what a suspect segment means to readers, and the manifest a removed
one leaves behind.

A segment silent past ``heartbeat_timeout_ms`` is suspect (segments.py): placement leaves it out at once, and
the answers built here leave its replicas out of gets and exists (a key whose every DRAM replica is suspect is
a miss, so no reader waits on a paused or dead process, unless it has a disk copy on a live node: then the get
answers ON_DISK and the reader promotes it from there). A node back within ``suspect_grace_ms`` resumes: its
objects never left the table. Silent longer, the segment is removed, and the objects that lost their last
replica with it are kept as its manifest (key, size, offset, checksum, pin) for ``MANIFEST_KEEP_S``: when the
same process (its owner token: segments.owner_digest) registers the same name and size again, every object of
the manifest whose key was not put again meanwhile is back at its offset, its bytes untouched in the node's
memory (readers check them against the xxh3 checksum as always). A process that never returns (SIGKILL)
leaves a manifest that ages out; the manifests hold at most ``MAX_MANIFEST_OBJECTS`` entries, oldest dropped.
With HA the manifest is journaled (the segment parked, its objects' records kept: Journal.segment_parked), so a
new leader rebuilds it (ha/recovery.py) and a failover between a node's removal and its return loses nothing;
a manifest used or dropped reports its leftover entries (``on_drop``) so their records go too.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

from kvplugins.store.master.allocator import reserve

log = logging.getLogger(__name__)
MANIFEST_KEEP_S = 600.0
MAX_MANIFEST_OBJECTS = 1 << 20


@dataclass
class Manifest:
    owner: bytes  # segments.owner_digest of the registering process
    size: int  # segment bytes
    entries: list  # [(key, size, offset, checksum, pin, pin_until)]
    until: float  # master-clock seconds: dropped after


class Manifests:
    """Manifests of removed segments by name, until their process re-registers or they age out."""

    def __init__(self, on_drop=None):
        self._by_name: dict[str, Manifest] = {}
        self._on_drop = on_drop  # (segment name, entries) of a manifest dropped unused

    def keep(self, seg, entries: list, now: float) -> None:
        """Record ``entries`` [(key, size, offset, checksum, pin, pin_until)]: the complete objects whose last
        replica was on ``seg``, removed for silence."""
        if seg.owner and entries:
            self._by_name[seg.name] = Manifest(seg.owner, seg.size, entries, now + MANIFEST_KEEP_S)
            self._bound()

    def take(self, seg) -> list:
        """The entries kept for ``seg`` (just registered) when it is the same process and size; else []."""
        entries = self.peek(seg)
        m = self._by_name.pop(seg.name, None)
        if m is not None and not entries:  # another process or size took the name: the objects are gone
            self._dropped(seg.name, m)
        return entries

    def peek(self, seg) -> list:
        """What ``take(seg)`` would return, kept."""
        m = self._by_name.get(seg.name)
        if m is None or m.size != seg.size or not seg.owner or not hmac.compare_digest(m.owner, seg.owner):
            return []
        return m.entries

    def tick(self, now: float) -> None:
        for name in [n for n, m in self._by_name.items() if m.until <= now]:
            log.info("manifest of segment %s dropped: its process did not return", name)
            self._dropped(name, self._by_name.pop(name))

    def __len__(self) -> int:
        return sum(len(m.entries) for m in self._by_name.values())

    def _bound(self) -> None:
        total = len(self)
        for name in sorted(self._by_name, key=lambda n: self._by_name[n].until):
            if total <= MAX_MANIFEST_OBJECTS:
                break
            m = self._by_name.pop(name)
            total -= len(m.entries)
            self._dropped(name, m)

    def _dropped(self, name: str, m: Manifest) -> None:
        if self._on_drop is not None and m.entries:
            self._on_drop(name, m.entries)


def free_block(seg, entries: list, nbytes: int) -> tuple[int, int] | None:
    """(offset, bytes) of a new allocation of up to ``nbytes`` in just registered ``seg`` that overlaps none of
    its manifest ``entries`` (the admission probe writes there before they are restored), or None when they
    leave no free byte."""
    blocks = [(off, size, key) for key, size, off, *_ in entries]
    bad = reserve(seg.allocator, blocks)
    size = min(nbytes, seg.allocator.largest_free())
    offset = seg.allocator.alloc(size) if size > 0 else None
    for off, _, key in blocks:
        if (off, key) not in bad:
            seg.allocator.free(off)
    return None if offset is None else (offset, size)


def restore(table, seg, entries: list, now: float) -> list:
    """Put the manifest ``entries`` of just re-registered ``seg`` back in ``table`` (complete, born ``now``),
    skipping keys stored again meanwhile; returns the objects restored."""
    blocks = [(off, size, key) for key, size, off, *_ in entries if key not in table]
    bad = reserve(seg.allocator, blocks)
    out = []
    for key, size, off, checksum, pin, pin_until in entries:
        if (off, key) in bad or key in table:
            continue
        out.append(
            table.new(
                key,
                size,
                [(seg.name, off)],
                complete=True,
                born=now,
                last_access=now,
                checksum=checksum,
                pin=pin,
                pin_until=pin_until,
            )
        )
    log.warning(
        "segment %s re-registered by its process: %d of %d objects of its manifest restored",
        seg.name,
        len(out),
        len(entries),
    )
    return out


def readable_cols(cols: tuple, suspect: set) -> tuple[tuple, list[int]]:
    """A get_cols answer (metadata.ObjectTable.get_cols, with ``more`` as [(j, locations)]) without the replicas
    on ``suspect`` segments: a key left with none is a miss. Returns (answer, indices of the hits turned into
    misses: the caller may still answer them from the disk tier)."""
    hits, sizes, names, regions, seg_idx, offs, more, sums, disk = cols
    bad = {i for i, n in enumerate(names) if n in suspect}
    if not bad and not any(loc[0] in suspect for _, locs in more for loc in locs):
        return cols, []
    index = {n: i for i, n in enumerate(names)}
    multi, kept, lost = dict(more), [], []
    for j, k in enumerate(seg_idx):
        if k < 0 or (k not in bad and j not in multi):
            continue
        alive = [loc for loc in multi.get(j, ()) if loc[0] not in suspect]
        if not alive:
            sizes[j], seg_idx[j] = -1, -1
            lost.append(j)
            continue
        name, region, off = alive[0]
        if name not in index:
            index[name] = len(names)
            names.append(name)
            regions.append(region)
        seg_idx[j], offs[j] = index[name], off
        if len(alive) > 1:
            kept.append((j, alive))
    return (hits - len(lost), sizes, names, regions, seg_idx, offs, kept, sums, disk), lost


def readable(table, keys: list, found: list, suspect: set, on_disk) -> list:
    """``found`` (per key: stored and complete) with False for keys whose every replica is on a ``suspect``
    segment and that ``on_disk`` (an Object predicate) does not keep on the disk tier."""
    if not suspect:
        return found
    out = list(found)
    for j, ok in enumerate(found):
        if ok:
            obj = table.get(keys[j])
            if obj.replicas and all(n in suspect for n, _ in obj.replicas) and not on_disk(obj):
                out[j] = False
    return out
