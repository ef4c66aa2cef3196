"""Small same-host batches in one native call from TransferEngine's entry (issue #35), as tcp_fast.py for TCP: the
routes the cma transport learnt, held by the native table ``_native.CmaFastRoutes`` (native/src/cma/fast.h).

Lifecycle, in call order (all from CmaTransport):
  1. ``add_local``      a registered region (add_region).
  2. ``put``            after a small batch to (remote descriptor, region) ran whole over cma as the router's first
                        choice for it: that route (the peer's pid, a duplicate of the pidfd peers.py watches it
                        with, the region's address and length). The next small batch there (at most spans.SMALL
                        spans, every span inside one registered local region, writable for a read, and inside the
                        remote region; no write into a region read-only to peers) is copied by ``native.read`` /
                        ``native.write`` with one process_vm_readv / process_vm_writev, the pidfd polled before and
                        after; they return the spans done, 0 where the table cannot take the batch, or -1 when the
                        copy failed or the peer exited (the caller calls ``drop`` and runs the batch its general way,
                        which names the error, and marks a peer the kernel refuses).
  3. ``drop``           a peer's routes; ``drop_local`` before a region goes (waits for the batches using it).
  4. ``clear``          at close.
"""

from __future__ import annotations

from kvplugins import native
from kvplugins.transfer.api import RegionInfo, SegmentDescriptor
from kvplugins.transfer.fast import FastTable
from kvplugins.transfer.spans import SMALL

MAX_ROUTES = 256


class FastRoutes(FastTable):
    """The native route table (module doc)."""

    def __init__(self) -> None:
        self.native = native.cma_fast_routes(SMALL, MAX_ROUTES)

    def put(self, remote: SegmentDescriptor, info: RegionInfo, pid: int, pidfd: int) -> None:
        """Route small batches to region ``info`` of ``remote`` (process ``pid``, watched by ``pidfd``, which the
        table duplicates) by cross-memory attach."""
        if info.addr is None:
            return
        self.native.put_route(
            remote, info.region_id, remote.segment_id, pid, pidfd, info.addr, info.length, info.readonly
        )  # fmt: skip
