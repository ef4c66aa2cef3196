"""Small TCP batches in one native call from TransferEngine's entry (issue #35), as rdma_fast.py for RDMA: the
routes the TCP transport learnt, held by the native table ``_native.TcpFastRoutes`` (native/src/tcp/fast.h).

Lifecycle, in call order (all from TcpTransport):
  1. ``add_local``      a registered region (add_region).
  2. ``put``            after a batch to (remote descriptor, region) ran whole over TCP as the router's first
                        choice for it (``Transport.first_choice``): that route (the peer's pooled connections, the
                        region's length, the frame payload limit). The next small batch there (at most spans.SMALL
                        spans and one frame of bytes, every span inside one registered local region, writable for a
                        read, and inside the remote region) is checked and sent as one frame over one idle pooled
                        connection by ``native.read`` / ``native.write`` alone (and hashed: ``digests`` as
                        rdma_fast.py); they return the spans done, 0 where the table cannot take the batch (nothing
                        sent: the general path runs it, and connects where no idle connection is left), or -1 when
                        the frame failed (the caller calls ``drop`` and runs the batch its general way, which names
                        the error).
  3. ``drop``           a peer's routes, after a failed batch; ``drop_local`` before a region goes (waits for the
                        batches using it).
  4. ``clear``          before the pooled connections close.
Routes are keyed by the descriptor object's identity (the table holds it); at most ``MAX_ROUTES`` (beyond: all
are dropped and learnt again). Fenced writes (the store's puts) never take it: their bytes carry a land-by time.
"""

from __future__ import annotations

from kvplugins import native
from kvplugins.transfer.api import RegionInfo, SegmentDescriptor
from kvplugins.transfer.fast import FastTable
from kvplugins.transfer.spans import SMALL

MAX_ROUTES = 256


class FastRoutes(FastTable):
    """The native route table (module doc) over the transport's pool of idle connections ``peers``."""

    def __init__(self, peers, timeout_ms: float):
        self.native = native.tcp_fast_routes(peers, SMALL, timeout_ms, MAX_ROUTES)

    def put(self, remote: SegmentDescriptor, info: RegionInfo, peer: str, limit: int) -> None:
        """Route small batches to region ``info`` of ``remote`` over the pooled connections to ``peer`` (host:port),
        at most ``limit`` payload bytes (one frame)."""
        self.native.put_route(remote, info.region_id, remote.segment_id, peer, info.length, limit, info.readonly)
