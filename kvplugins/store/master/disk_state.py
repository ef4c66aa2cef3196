"""The master's view of the disk tier: which node holds a disk copy of which object, the commands queued for each
node, and the copies in flight (offload, promote, migrate). Pure bookkeeping; tiering.py drives it.

An object has a disk copy on each node of its DRAM replicas that has a tier (an offload writes them all: with
``replicas`` >= 2 no single host's disk holds the only copy). A disk copy or a flight names the Object it belongs to and is valid only while the table still maps the key to
that very Object (a removed and re-put key never reuses an old copy). A disk-only object holds no DRAM and is
parked outside the table's LRU lists, so eviction never picks it. An object in flight stays evictable by an
on-demand eviction (a put never waits for disk): it is dropped, the flight cancelled and its file deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INF = float("inf")
FLIGHT_TIMEOUT_S = 30.0  # an offload/migration a node has not confirmed by then is abandoned
POLL_BATCH = 64  # commands handed to a node per poll
MAX_FLIGHTS = 32  # migrations (drain and replica tasks) in flight per source node
TTL_MARGIN_S = 5.0  # a migrate command must start this long before its flight's deadline (node-checked)


@dataclass
class Copy:
    segment: str  # the node (by its segment name) whose disk holds the file
    obj: object  # metadata.Object: a view, dead once the object leaves the table
    checksum: int
    size: int = field(init=False)  # obj.size, readable after obj is gone

    def __post_init__(self):
        self.size = self.obj.size


@dataclass
class Flight:
    kind: str  # "offload" | "promote" | "migrate"
    obj: object  # metadata.Object: a view, dead once the object leaves the table
    segment: str  # the node doing the work (an offload: the first of ``pending``)
    deadline: float
    dest: tuple | None = None  # (Segment, offset) the node writes into (promote, migrate)
    fid: int = 0  # migrate: the id its command and the node's report carry (a late report of an
    # ended flight never matches a newer flight of the same key)
    pending: set = field(default_factory=set)  # offload: the nodes still writing their copy
    size: int = field(init=False)  # obj.size, readable after obj is gone

    def __post_init__(self):
        self.size = self.obj.size


@dataclass
class DiskNode:
    """One `kvplugins store` node's tier link (nodes without a disk have endpoint '' and capacity 0)."""

    segment: str
    endpoint: str  # host:port of its promote endpoint ('' = no disk tier)
    capacity: int  # bytes
    disk_id: str = ""  # identity of its disk directory (survives process restarts)
    keys: set = field(default_factory=set)  # keys with a disk copy here
    queue: list = field(default_factory=list)  # commands not yet polled
    offloading: int = 0  # bytes of offloads in flight
    retry_at: float = 0.0  # after a failed offload: no new offload before this time (master clock, s)
    draining: bool = False


class Frozen:
    """A draining segment's allocator: refuses every new allocation (so placement skips the segment) but frees
    and reports as before. ``inner`` is the real allocator (promotions during a drain still use it)."""

    def __init__(self, inner):
        self.inner = inner

    def alloc(self, size: int):
        return None

    def alloc_many(self, sizes):
        return None

    @property
    def free_bytes(self) -> int:
        return 0

    def largest_free(self) -> int:
        return 0

    def __getattr__(self, name):
        return getattr(self.inner, name)


def raw_allocator(seg):
    """The allocator behind a possibly frozen segment."""
    return getattr(seg.allocator, "inner", seg.allocator)
