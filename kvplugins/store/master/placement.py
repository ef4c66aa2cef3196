"""Choosing segments for a new object's replicas (the master's half of store/placement.py).

Order of the candidates: the preferred segment (if any and registered) first, then the service's most-free-first
order (rotated per key so a batch spreads). Replicas go to distinct segments, and on distinct hosts first: a
first pass takes only segments on hosts not used yet, a second pass fills the rest from any unused segment.
"""

from __future__ import annotations

from kvplugins.store.master.segments import Segment


def preferred_first(order: list[Segment], preferred: str) -> list[Segment]:
    """``order`` with the segment named ``preferred`` moved to the front (unchanged if absent or '')."""
    if not preferred:
        return order
    first = [s for s in order if s.name == preferred]
    return first + [s for s in order if s.name != preferred] if first else order


def try_place(size: int, want: int, order: list[Segment]) -> list[tuple[Segment, int]] | None:
    """Allocate ``size`` bytes on ``want`` distinct segments of ``order`` (distinct hosts first), or None (then
    nothing stays allocated)."""
    placed: list[tuple[Segment, int]] = []
    if want == 1:
        for seg in order:
            off = seg.allocator.alloc(size)
            if off is not None:
                return [(seg, off)]
        return None
    hosts: set[str] = set()
    for new_host_only in (True, False):
        for seg in order:
            if len(placed) == want:
                return placed
            if any(s is seg for s, _ in placed) or (new_host_only and host_of(seg) in hosts):
                continue
            off = seg.allocator.alloc(size)
            if off is not None:
                placed.append((seg, off))
                hosts.add(host_of(seg))
    if len(placed) == want:
        return placed
    for seg, off in placed:
        seg.allocator.free(off)
    return None


def host_of(seg: Segment) -> str:
    return str(seg.descriptor.get("host_id", ""))
