"""Shared-memory transport (same host): map the peer's memfd region once and copy directly.

The peer's memory arrives as a file descriptor from its owner over a Unix socket (fdpass.py), never by opening a
path a descriptor named; this process hands its own alloc_shared memory out the same way (``offer``). One copy
per entry via the native ``copy_batch`` (GIL released); no socket on the data path. Peer liveness is checked
per batch with a pidfd, so a dead peer gives TransferFailed rather than writes into memory nobody reads.
Every mapping is also listed in a native table (``maps``, native.shm_maps) with a duplicate of its peer's pidfd,
for the store client's one-call reads (native.get_one); a mapping leaves it before it is unmapped.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from kvplugins import native
from kvplugins.errors import TransferError, TransferFailed
from kvplugins.transfer import fdpass
from kvplugins.transfer.api import Region, RegionInfo, SegmentDescriptor
from kvplugins.transfer.peers import PeerWatch
from kvplugins.transfer.shmem import Mapping, map_fd
from kvplugins.transfer.transport import Deadline, Entry, Op, Transport


class ShmTransport(Transport):
    """Offers {"pid": ..., "fd_socket": ...}; reaches a region when the peer has our host_id, an fd socket and the
    region has shm_path (it lives in shared memory)."""

    name = "shm"
    hashes_in_copy = True

    def __init__(self, host_id: str, copy_threads: int = 0):
        """``copy_threads``: threads per batch copy of >= 4 MiB; 0 = the usable cores, at most 4."""
        self._host_id = host_id
        self._threads = copy_threads or min(4, len(os.sched_getaffinity(0)))
        self._lock = threading.Lock()
        self._maps: dict[tuple[str, int], Mapping] = {}
        self._peers = PeerWatch(self.name)  # a pidfd per peer: a dead one fails its batches
        self._server: fdpass.FdServer | None = None  # hands our shared regions out; started by share()
        self.maps = native.shm_maps()  # every mapping of _maps, for native one-call reads

    def endpoint(self) -> dict[str, Any]:
        return {"pid": os.getpid(), **({"fd_socket": self._server.name} if self._server else {})}

    def share(self, region: Region, mapping: Mapping) -> None:
        """Hand exported ``region`` (alloc_shared memory ``mapping``) to same-host peers; memory that is not a
        sealed memfd (the posix backend) is not handed out."""
        if region.exported and mapping.fd >= 0 and fdpass.sealed(mapping.fd):
            with self._lock:
                if self._server is None:
                    self._server = fdpass.FdServer()
                self._server.offer(region.region_id, mapping.fd, region.length)

    def remove_region(self, region: Region) -> None:
        if self._server is not None:
            self._server.withdraw(region.region_id)

    def reaches(self, remote: SegmentDescriptor, region: RegionInfo) -> bool:
        ep = remote.transports.get("shm")
        return (
            remote.host_id == self._host_id
            and isinstance(region.shm_path, str)
            and bool(region.shm_path)
            and isinstance(ep, dict)
            and type(ep.get("pid")) is int
            and ep["pid"] > 0
            and isinstance(ep.get("fd_socket"), str)
        )

    def transfer(self, op: Op, entries: list[Entry], deadline: Deadline) -> list[TransferError | None]:
        status: list[TransferError | None] = [None] * len(entries)
        dst, src, lens = [], [], []
        maps: dict[tuple[str, int], Any] = {}  # per batch; holding the pins keeps every map alive
        for i, e in enumerate(entries):
            key = (e.remote.segment_id, e.remote_region.region_id)
            got = maps.get(key)
            if got is None:
                try:
                    got = maps[key] = self._mapping(e.remote, e.remote_region)
                except TransferFailed as err:
                    got = maps[key] = err
            if isinstance(got, TransferFailed):
                status[i] = got
                continue
            remote = got[1] + e.remote_offset
            dst.append(remote if op is Op.WRITE else e.local_addr)
            src.append(e.local_addr if op is Op.WRITE else remote)
            lens.append(e.length)
        if lens:
            native.copy_batch(dst, src, lens, self._threads)
        return status

    def transfer_spans(self, op: Op, batch, deadline: Deadline) -> list[TransferError | None] | None:
        """The whole span batch in one native copy_batch call (one remote region, so one mapping); with
        ``batch.digests`` the copy also hashes each span (one pass over the bytes)."""
        try:
            pin, base = self._mapping(batch.remote, batch.info)
        except TransferFailed as err:
            return [err] * len(batch)
        if isinstance(batch.roffs, list):
            remote = [base + r for r in batch.roffs]
        else:
            remote = batch.roffs + np.uint64(base)
        dst, src = (remote, batch.addrs) if op is Op.WRITE else (batch.addrs, remote)
        native.copy_batch(dst, src, batch.lens, self._threads, batch.digests)
        batch.hashed = batch.digests is not None
        del pin
        return None

    def _mapping(self, remote: SegmentDescriptor, region: RegionInfo) -> tuple[object, int]:
        """(pin, address) of the peer region mapped here. Raises TransferFailed."""
        self._check_alive(remote)
        key = (remote.segment_id, region.region_id)
        with self._lock:
            m = self._maps.get(key)
        if m is None:
            ep = remote.transports["shm"]
            fd = fdpass.fetch(ep["fd_socket"], ep["pid"], region.region_id, region.length)
            mine = map_fd(fd, region.length, f"{remote.segment_id}:{region.region_id}")
            with self._lock:
                m = self._maps.setdefault(key, mine)
                if m is mine:
                    self.maps.add(
                        remote.segment_id, region.region_id, m.addr, region.length, self._peers.pidfd(remote.segment_id)
                    )
            if m is not mine:  # another thread mapped it first
                mine.close()
        pin = m.array
        if pin is None:
            raise TransferFailed(f"mapping of {region.shm_path} was closed")
        return pin, m.addr

    def _check_alive(self, remote: SegmentDescriptor) -> None:
        try:
            self._peers.check(remote.segment_id, remote.transports["shm"]["pid"])
        except TransferFailed:
            self._forget(remote.segment_id)
            raise

    def _forget(self, segment_id: str) -> None:
        """Unmap a dead peer's regions (its memory is freed once nobody maps it)."""
        with self._lock:
            maps = [self._maps.pop(k) for k in list(self._maps) if k[0] == segment_id]
            self.maps.forget(segment_id)  # waits for native reads from them
        for m in maps:
            m.close()

    def stats(self) -> dict[str, Any]:
        """The reads native one-call gets did from the mappings (counted beside the engine's own entries)."""
        entries, nbytes = self.maps.counts()
        return {"entries": entries, "bytes": nbytes}

    def close(self) -> None:
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
            self.maps.clear()
            server, self._server = self._server, None
        if server is not None:
            server.close()
        for m in maps:
            m.close()
        self._peers.close()
