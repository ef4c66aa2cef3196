"""The segment registry: every DRAM segment in the pool, its allocator, and its last heartbeat.

A segment is one exported region of one process's transfer engine; its name is
``"<engine segment_id>:<region_id>"``. A segment not heart-beating for ``heartbeat_timeout_ms`` is *suspect*: it
gets no new placement (``by_free_space`` leaves it out) and its replicas are not handed to readers; a heartbeat
ends that. Silent for ``suspect_grace_ms`` more, the master's sweep removes it (its objects lose that replica;
see service.py and liveness.py).

A name is bound to its registering process (issue #30): register_segment carries that process's random owner
token (store/node/segment.py) and the registry keeps its SHA-256; registering or unregistering a live name with
another token is refused (SegmentOwned), so no other peer can replace a node's descriptor or wipe its objects.
The same process re-registers its name (after the master forgot it) with the same token.

A segment registered over RPC is *unadmitted* until the master's write-and-read-back probe of it succeeded
(admission.py): no placement meanwhile, like a suspect one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass

from kvplugins.store.master.allocator import Allocator
from kvplugins.transfer.api import SegmentDescriptor

log = logging.getLogger(__name__)
MAX_PER_OWNER = 64  # segments one process (owner token) may have registered at once


@dataclass
class Segment:
    name: str
    descriptor: dict  # SegmentDescriptor.to_wire() of the owning engine
    region_id: int
    allocator: Allocator
    last_heartbeat: float  # seconds, master clock (the objects with a replica here: ObjectTable.on_segment)
    owner: bytes = b""  # SHA-256 of the registering process's owner token (b"": unbound, in-process use)
    identity: str = ""  # the registering named credential (master/quotas.py; "" = the cluster secret)

    @property
    def size(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used_bytes

    def usage(self) -> float:
        return self.used / self.size


class SegmentOwned(ValueError):
    """A live segment name registered by another process (another owner token)."""


class TooMany(ValueError):
    """The registry holds max_segments segments, or MAX_PER_OWNER of one process."""


def owner_digest(token: str) -> bytes:
    """The registry's record of an owner token (b"" for none)."""
    return hashlib.sha256(token.encode()).digest() if token else b""


class SegmentRegistry:
    def __init__(self, align: int):
        self.align = align
        self._segments: dict[str, Segment] = {}
        self.suspect: set[str] = set()  # names silent past the heartbeat timeout, not yet removed
        self.unadmitted: set[str] = set()  # names whose admission probe has not succeeded yet (admission.py)

    def add(
        self,
        wire: dict,
        region_id: int,
        size: int,
        now: float,
        owner: bytes = b"",
        limit: int = 0,
        identity: str = "",
        per_identity: int = 0,
    ) -> Segment:
        """Validate and add a segment (replacing one of the same name and ``owner``, an owner_digest) registered
        by the named credential ``identity`` ("" = the cluster secret). Raises SegmentOwned (the live name has
        another owner), TooMany (``limit`` segments, MAX_PER_OWNER of this owner or ``per_identity`` of this
        identity are registered), ValueError/ProtocolError (a bad descriptor)."""
        desc = SegmentDescriptor.from_wire(wire)
        region = desc.region(int(region_id))
        if not 0 < int(size) <= region.length:
            raise ValueError(f"segment size {size} must be in (0, region length {region.length}]")
        name = f"{desc.segment_id}:{region.region_id}"
        self.check_owner(name, owner, "register")
        if name not in self._segments:
            self._check_room(owner, limit, identity, per_identity)
        seg = Segment(name, wire, region.region_id, Allocator(int(size), self.align), now, owner, identity)
        self._segments[name] = seg
        self.suspect.discard(name)
        return seg

    def repeated(self, wire: dict, region_id: int, size: int, owner: bytes) -> Segment | None:
        """The live segment this registration repeats (same name, descriptor and size, by the same process:
        ``owner``, non-empty), or None. A repeat is a resent request (its RPC timed out and was retried), not new
        memory: the segment and the objects on it stay."""
        seg = self._segments.get(f"{wire.get('segment_id')}:{region_id}") if isinstance(wire, dict) else None
        if seg is None or not owner or not seg.owner or not hmac.compare_digest(seg.owner, owner):
            return None
        return seg if seg.descriptor == wire and seg.region_id == region_id and seg.size == size else None

    def restart_clocks(self, now: float) -> None:
        """Count every segment as heard at ``now``: a new HA leader, once recovered, gives each a full heartbeat
        timeout from when it starts serving (it has heard none yet; its recovery may have taken longer)."""
        for seg in self._segments.values():
            seg.last_heartbeat = now

    def check_owner(self, name: str, owner: bytes, what: str) -> None:
        """Raise SegmentOwned when the live segment ``name`` is bound to an owner other than ``owner``."""
        seg = self._segments.get(name)
        if seg is not None and seg.owner and not hmac.compare_digest(seg.owner, owner):
            raise SegmentOwned(
                f"cannot {what} segment {name}: it is live and was registered by another process "
                "(segment names are bound to their registering process; a restarted node "
                "registers under its new name)"
            )

    def _check_room(self, owner: bytes, limit: int, identity: str, per_identity: int) -> None:
        if limit and len(self._segments) >= limit:
            raise TooMany(
                f"{len(self._segments)} segments are registered, the master's max_segments; raise "
                "--max-segments or stop the processes whose segments are not needed"
            )
        if owner and sum(s.owner == owner for s in self._segments.values()) >= MAX_PER_OWNER:
            raise TooMany(f"this process has {MAX_PER_OWNER} segments registered, the most one process may")
        if identity and per_identity and sum(s.identity == identity for s in self._segments.values()) >= per_identity:
            raise TooMany(
                f"credential {identity} has {per_identity} segments registered, the master's "
                "max_segments_per_identity; unregister some, raise it, or give each node its own "
                "credential (kvplugins credential --role node --name NAME)"
            )

    def get(self, name: str) -> Segment | None:
        return self._segments.get(name)

    def pop(self, name: str) -> Segment | None:
        self.suspect.discard(name)
        self.unadmitted.discard(name)
        return self._segments.pop(name, None)

    def heartbeat(self, name: str, now: float) -> bool:
        """Record a heartbeat of ``name`` (a suspect one is live again); whether the segment is known."""
        seg = self._segments.get(name)
        if seg is not None:
            seg.last_heartbeat = now
            if name in self.suspect:
                self.suspect.discard(name)
                log.warning("segment %s is heart-beating again; it takes placements again", name)
        return seg is not None

    def sweep(self, now: float, timeout_s: float, grace_s: float) -> tuple[list[str], list[str]]:
        """Mark segments silent past ``timeout_s`` suspect. Returns (names newly suspect, names silent past
        ``timeout_s + grace_s``: the caller removes those)."""
        new, dead = [], []
        for name, seg in self._segments.items():
            silent = now - seg.last_heartbeat
            if silent > timeout_s + grace_s:
                dead.append(name)
            elif silent > timeout_s and name not in self.suspect:
                self.suspect.add(name)
                new.append(name)
                log.warning(
                    "segment %s silent for %.1f s: suspect (no new placement, its replicas not read); "
                    "removed after %.0f s more",
                    name,
                    silent,
                    grace_s,
                )
        return new, dead

    def by_free_space(self) -> list[Segment]:
        """Live (not suspect, admitted) segments, most free bytes first (placement order)."""
        live = [s for s in self._segments.values() if s.name not in self.suspect and s.name not in self.unadmitted]
        return sorted(live, key=lambda s: s.allocator.free_bytes, reverse=True)

    def __iter__(self):
        return iter(list(self._segments.values()))

    def __len__(self) -> int:
        return len(self._segments)
