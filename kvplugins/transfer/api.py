"""The transfer core's public types. Implementation: engine.py (TransferEngine) and one module per transport.

Lifecycle of a TransferEngine (one per process), in call order:
  1. ``TransferEngine(config)``         starts the enabled transports (the TCP transport's server binds
                                        ``config.host`` on port 0 unless a port is given).
  2. ``register(mem)`` / ``alloc_shared(nbytes)``
                                        returns a Region. ``alloc_shared`` memory lives in memfd/POSIX shm, so
                                        same-host peers map it and copy directly (one copy, no socket).
                                        ``export=True`` lets remote peers read/write the region.
  3. ``descriptor()``                   a SegmentDescriptor to hand to peers (msgpack-able via to_wire()).
  4. ``batch_write`` / ``batch_read``   lists of TransferRequest; per-entry status (None or a TransferError).
     ``submit_write`` / ``submit_read`` the same, returning a concurrent.futures.Future of that list.
  5. ``unregister(region)``, ``close()``.
Always safe: ``descriptor()``, ``stats()``. A batch mutates only the destination bytes of its entries.
The shape fits RDMA one-sided READ/WRITE: (local registered region, offset) <-> (remote region id, offset).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Union

from kvplugins.errors import OutOfRange, ProtocolError

# A transport's endpoint fields (host, port, nics, gid, ...): msgpack scalars or lists of them
EndpointValue = Union[str, int, float, bool, None, list[Union[str, int, float, bool, None]]]
Endpoint = dict[str, EndpointValue]


@dataclass(frozen=True)
class DeviceMemory:
    """Memory host code cannot touch directly: device ``index`` of ``kind`` ("cuda", or "emulated": host memory
    treated as device memory, for tests without a GPU). ``set_device_fn`` and ``memcpy_fn`` are the addresses of
    C functions with cudaSetDevice's and cudaMemcpy's signatures (``int(int)``; ``int(void* dst, const void* src,
    size_t bytes, int kind)``, kind 1 host to device, 2 device to host; 0 is success): transfer/device.py."""

    kind: str
    index: int
    set_device_fn: int
    memcpy_fn: int


@dataclass(frozen=True)
class Region:
    """A registered local memory region: ``length`` bytes at address ``addr``.

    shm_path: for memory in memfd/POSIX shm, where it lives (for logs; else None). No peer opens it: same-host
        peers get the memory as a file descriptor from its owner (transfer/fdpass.py).
    exported: whether remote peers may read/write it through this engine's servers.
    readonly: the memory is read-only (e.g. ``bytes``): it can be a write source, never a destination.
    peer_readonly: exported for peers to read only (their writes are refused, over every transport that serves
        them: TCP, RDMA without remote write access); this process may still read into it (kvplugins.p2p's
        replicas). A same-host peer of the same user can write any of this process's memory anyway (cma).
    device: set for device memory (a GPU's, transfer/device.py): peers reach it over TCP only, the owner's TCP
        server staging each frame through host memory with the device's copy function; no shm, cma or RDMA MR.
    """

    region_id: int
    addr: int
    length: int
    shm_path: str | None = None
    exported: bool = False
    readonly: bool = False
    peer_readonly: bool = False
    device: DeviceMemory | None = None

    @property
    def peers_write(self) -> bool:
        """Whether peers may write into it (exported, and neither readonly nor peer_readonly)."""
        return self.exported and not (self.readonly or self.peer_readonly)


@dataclass(frozen=True)
class RegionInfo:
    """A region as peers see it in a SegmentDescriptor. ``rdma``: where an RDMA transport registered it,
    (address, (rkey per NIC of the endpoint's "nics" list)), for one-sided READ/WRITE; else None. ``addr``: its
    address in the owner process, for same-host cross-memory-attach copies (transfer/cma.py); else None.
    ``readonly``: peers may only read it (the owner's Region.readonly or peer_readonly): a writer refuses up front
    (routing.refused_write), so no RDMA queue pair meets a remote access error; the owner's TCP server and RDMA
    memory registration refuse such writes anyway."""

    region_id: int
    length: int
    shm_path: str | None = None
    rdma: tuple[int, tuple[int, ...]] | None = None
    addr: int | None = None
    readonly: bool = False


@dataclass(frozen=True)
class SegmentDescriptor:
    """What a process exports: host identity, the transports it offers (fastest first) with their
    endpoint info, and its exported regions. ``to_wire()``/``from_wire()`` give a msgpack-able dict."""

    segment_id: str
    host_id: str
    transports: dict[str, Endpoint]
    regions: tuple[RegionInfo, ...] = field(default_factory=tuple)

    def to_wire(self) -> dict[str, object]:
        return {
            "v": 1,
            "segment_id": self.segment_id,
            "host_id": self.host_id,
            "transports": self.transports,
            "regions": [_region_row(r) for r in self.regions],
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, object]) -> "SegmentDescriptor":
        """The descriptor of a to_wire() dict (as a peer sent it). Raises ProtocolError naming what is malformed
        (the master's schema, store/wire/schema.py Descriptor, checked sizes and types before this)."""
        try:
            if d["v"] != 1:
                raise ProtocolError(f"segment descriptor version {d['v']!r} unsupported (this build speaks 1)")
            rows, transports = d["regions"], d["transports"]
            if not isinstance(rows, (list, tuple)) or not isinstance(transports, dict):
                raise TypeError("regions must be a list and transports a map")
            regions = tuple(_region_info(r) for r in rows)
            return cls(str(d["segment_id"]), str(d["host_id"]), dict(transports), regions)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ProtocolError(f"malformed segment descriptor: {e!r}") from e

    def region(self, region_id: int) -> RegionInfo:
        for r in self.regions:
            if r.region_id == region_id:
                return r
        raise OutOfRange(f"segment {self.segment_id} exports no region {region_id}")


def _region_row(r: RegionInfo) -> list[object]:
    """[id, length, shm_path], then [addr, [rkey, ...]] (or None), then the address (or None), then 1 when
    read-only to peers: trailing empty items are left off."""
    row: list[object] = [r.region_id, r.length, r.shm_path]
    tail = [None if r.rdma is None else [r.rdma[0], list(r.rdma[1])], r.addr, 1 if r.readonly else None]
    while tail and tail[-1] is None:
        tail.pop()
    return row + tail


def _region_info(row: object) -> RegionInfo:
    """A RegionInfo from a wire row [id, length, shm_path] with optional [addr, [rkey, ...]] (or None), address
    (or None) and read-only items (_region_row)."""
    if not isinstance(row, (list, tuple)) or len(row) not in (3, 4, 5, 6):
        raise ValueError(f"a region row is a list of 3 to 6 items, got {row!r:.80}")
    rdma = None
    if len(row) >= 4 and row[3] is not None:
        raddr, rkeys = row[3]
        rdma = (int(raddr), tuple(int(k) for k in rkeys))
    shm_path, addr = row[2], row[4] if len(row) >= 5 else None
    if shm_path is not None and not isinstance(shm_path, str):
        raise ValueError("a region's shm_path must be a string or None")
    if addr is not None and (type(addr) is not int or not 0 < addr < 1 << 64):
        raise ValueError(f"a region's address must be an integer in (0, 2**64), got {addr!r:.40}")
    if len(row) == 6 and row[5] not in (None, 1):
        raise ValueError(f"a region's read-only mark must be 1 or None, got {row[5]!r:.40}")
    return RegionInfo(int(row[0]), int(row[1]), shm_path, rdma, addr, len(row) == 6 and row[5] == 1)


@dataclass(frozen=True)
class TransferRequest:
    """One entry of a batch: ``length`` bytes between local (region, offset) and remote (segment, region, offset).
    For a write the local side is the source; for a read it is the destination."""

    local: Region
    local_offset: int
    remote: SegmentDescriptor
    remote_region: int
    remote_offset: int
    length: int
