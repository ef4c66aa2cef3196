"""The small interface every transport implements (shm, cma, rdma, tcp).

A transport moves entries between a local registered region and a peer's exported region, one-sided:
the peer's CPU does no per-entry work for shm (and would do none for RDMA READ/WRITE); TCP's peer runs a
server. The engine picks the transport per entry and retries TransferFailed entries on the next one.

Fitting RDMA: add_region()/remove_region() see every local registration (ibv_reg_mr / dereg), endpoint()
publishes what peers need (GID, QP info, per-region rkey + address), and each Entry carries the local
Region (for its lkey) and the remote RegionInfo + offset (for the rkey), so transfer() can post one
one-sided READ/WRITE work request per entry and wait for completions until the deadline.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvplugins.errors import TransferError
from kvplugins.transfer.api import Region, RegionInfo, SegmentDescriptor
from kvplugins.transfer.spans import as_list

if TYPE_CHECKING:
    from kvplugins.transfer.spans import SpanBatch


class Op(enum.IntEnum):
    """Direction of a batch: WRITE = local -> remote, READ = remote -> local."""

    WRITE = 1
    READ = 2


@dataclass(frozen=True)
class Entry:
    """One validated batch entry. ``local_addr`` lies inside ``local`` (a registered Region, so an RDMA
    transport can find its memory key); the remote side is (segment, region id, offset). ``pin`` keeps
    the local memory mapped while the entry is in flight."""

    local: Region
    local_addr: int
    remote: SegmentDescriptor
    remote_region: RegionInfo
    remote_offset: int
    length: int
    pin: Any = None


class Deadline:
    """When a batch must be done: ``at`` in time.monotonic() seconds, from a timeout of ``timeout_ms``.
    ``fenced`` (writes): its bytes must land by then or not at all; ``land_by_ms`` is that moment in unix ms, for
    a transport whose peer can check it (TCP sends it as the frames' "dl", wire.py); one-sided transports (shm,
    same-host, RDMA) only stop issuing at ``at``."""

    def __init__(self, timeout_ms: float, fenced: bool = False):
        self.timeout_ms = float(timeout_ms)
        self.at = time.monotonic() + self.timeout_ms / 1000.0
        self.land_by_ms = int(time.time() * 1000 + self.timeout_ms) if fenced else 0

    def remaining(self) -> float:
        """Seconds left (<= 0 when passed)."""
        return self.at - time.monotonic()


class Transport(ABC):
    """One way to move bytes. Implementations are thread-safe: batches may run concurrently."""

    name: str = ""
    hashes_in_copy: bool = False  # transfer_spans fills batch.digests (and sets batch.hashed) when asked

    @abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """What peers need to reach this process, published in SegmentDescriptor.transports[name]."""

    @abstractmethod
    def reaches(self, remote: SegmentDescriptor, region: RegionInfo) -> bool:
        """Whether this transport can move bytes to/from ``region`` of ``remote`` (checked per entry)."""

    @abstractmethod
    def transfer(self, op: Op, entries: list[Entry], deadline: Deadline) -> list[TransferError | None]:
        """Move every entry; return one status per entry (None = done). TransferFailed entries may be retried on another transport; OutOfRange ones are final.
        Must return by the deadline (plus a small margin), never hang."""

    def transfer_spans(self, op: Op, batch: "SpanBatch", deadline: Deadline) -> list[TransferError | None] | None:
        """The array form (spans.py): move every span of ``batch``; None when all succeeded, else one status
        per span. Default: one Entry per span through transfer(); transports override it to skip that."""
        entries = [
            Entry(reg, a, batch.remote, batch.info, r, n, batch.pins)
            for reg, a, r, n in zip(batch.regions, as_list(batch.addrs), as_list(batch.roffs), as_list(batch.lens))
        ]
        return self.transfer(op, entries, deadline)

    def add_region(self, region: Region) -> None:
        """A local region was registered (an RDMA transport registers it with the NIC here and lists
        its key in endpoint()). Default: nothing to do."""

    def region_info(self, region: Region, info: RegionInfo) -> RegionInfo:
        """What peers need about exported ``region`` for this transport, added to ``info`` (the RDMA
        transport adds its address and rkeys). Default: ``info`` unchanged."""
        return info

    def share(self, region: Region, mapping) -> None:
        """Local ``region`` was allocated as shared memory ``mapping`` (shmem.Mapping): the shm transport hands
        it to same-host peers. Default: nothing to do."""

    def remove_region(self, region: Region) -> None:
        """A local region is being unregistered; stop using its memory. Default: nothing to do."""

    def first_choice(self, remote: SegmentDescriptor, info: RegionInfo) -> None:
        """A small batch to region ``info`` of ``remote`` ran whole on this transport, the router's first choice for
        that region (the TCP transport routes the next ones natively from the engine's entry). Default: nothing."""

    def stats(self) -> dict[str, Any]:
        """This transport's own counters, merged into TransferEngine.stats()[name]. Default: none."""
        return {}

    def close(self) -> None:
        """Release sockets, mappings and threads. Idempotent."""
