"""Rebuild a fresh MasterService from the journal (EtcdJournal.load) when a master becomes leader.

Segments are re-added from their stored descriptors (same names) with a heartbeat of ``now``: a node that is
still alive keeps heart-beating the new leader (its bytes never moved), one that died times out after
heartbeat_timeout_ms like any silent segment and its objects are lost then. Every recovered object is complete,
unleased, and re-marks its bytes allocated in its segment's allocator; objects naming an unknown segment or an
offset that does not fit are dropped (logged, counted in ``dropped``). Pending puts of the old leader are not
recovered: their writers' put_commit answers "expired" and the put is not acknowledged.
"""
from __future__ import annotations

import logging

from kvplugins.errors import KVPluginsError
from kvplugins.store.master.metadata import Object

log = logging.getLogger(__name__)


def restore(service, segs: list, objs: list, now: float) -> dict:
    """Load ``segs`` [(name, wire, region id, size)] and ``objs`` [(key, size, replicas, checksum, pin)] (oldest
    first) into ``service`` (an empty MasterService). Returns {"segments", "objects", "dropped"}."""
    for name, wire, region_id, size in segs:
        try:
            seg = service.segments.add(wire, region_id, size, now)
        except (KVPluginsError, ValueError) as e:       # a descriptor that decodes but does not hold together
            log.warning("journal segment %s skipped: %s", name, e)
            continue
        if seg.name != name:
            log.warning("journal segment %s re-added as %s", name, seg.name)
    placed: dict[str, list] = {}                       # segment name -> [(offset, size, key)]
    kept, dropped = [], 0
    for key, size, replicas, *extra in objs:
        good = [(n, off) for n, off in replicas if service.segments.get(n) is not None]
        if not good:
            dropped += 1
            continue
        kept.append((key, size, good, *extra))
        for n, off in good:
            placed.setdefault(n, []).append((off, size, key))
    bad = set()
    for name, blocks in placed.items():
        bad |= _reserve(service.segments.get(name), blocks)
    for key, size, replicas, *extra in kept:
        replicas = [(n, off) for n, off in replicas if (n, off) not in bad]
        if not replicas:
            dropped += 1
            continue
        _add(service, Object(key, size, replicas, complete=True, last_access=now), *extra)
    if dropped:
        log.warning("recovery dropped %d objects (segment unknown or offsets overlapping)", dropped)
    return {"segments": len(segs), "objects": len(service.table), "dropped": dropped}


def _add(service, obj: Object, checksum=None, pin: int = 0) -> None:
    """Add recovered ``obj`` with its checksum and hard pin (set before ``add``: the pin picks its LRU list)."""
    obj.checksum, obj.pin = checksum, pin
    service.table.add(obj)
    for name, _ in obj.replicas:
        service.segments.get(name).keys.add(obj.key)


def _reserve(seg, blocks: list) -> set:
    """Mark ``blocks`` [(offset, size, key)] allocated in ``seg``'s fresh allocator, using only its public
    first-fit ``alloc``: gaps are filled with filler allocations (freed at the end), so each block lands at
    its own offset. Returns {(segment name, offset)} of blocks that could not be placed (overlap, out of range)."""
    alloc, bad, fillers, pos = seg.allocator, set(), [], 0
    for off, size, _ in sorted(blocks):
        if off < pos or off % alloc.align or off + alloc.rounded(size) > alloc.capacity:
            bad.add((seg.name, off))
            continue
        if off > pos:
            fillers.append(alloc.alloc(off - pos))
        got = alloc.alloc(size)
        if got != off:                       # not with first-fit from a fresh allocator; never overlap
            if got is not None:
                fillers.append(got)
            bad.add((seg.name, off))
            continue
        pos = off + alloc.rounded(size)
    for f in fillers:
        alloc.free(f)
    return bad
