"""Small RDMA batches in one native call from TransferEngine's entry (issue #35): the routes the RDMA transport
learnt, held by the native table ``_verbs.FastRoutes`` (native/src/verbs/fast.cpp).

Lifecycle, in call order (all from RdmaTransport):
  1. ``add_local``      a registered region and its lkey per NIC (add_region).
  2. ``put``            after a small batch to (remote descriptor, region) went well on a path: that route (its
                        queue pair, remote address, rkey). The next small batch there (at most spans.SMALL
                        spans and ``rdma_max_wr`` bytes, every span inside one writable-for-a-read local region
                        and the remote region) is checked and posted by ``native.read`` / ``native.write`` /
                        ``native.run`` alone (and hashed: ``digests``, a writable uint64 array of one entry per
                        span, gets each span's xxh3_64 of its local bytes); they return the spans done, 0 where the table cannot take the
                        batch (nothing posted: the general path runs it), or -1 when a work request failed (the
                        queue pair is killed; the caller calls ``drop`` and runs the batch its general way).
  3. ``drop``           a peer's routes, when one of its paths failed; ``drop_local`` before an MR goes.
  4. ``clear``          before the queue pairs close.
The table keys a route by the descriptor object's identity and holds that object and the queue pair's until the
route and every batch on it are gone; at most ``MAX_ROUTES`` routes (beyond: all are dropped and learnt again).
"""

from __future__ import annotations

from kvplugins.transfer import rdma_verbs as verbs
from kvplugins.transfer.api import Region, SegmentDescriptor
from kvplugins.transfer.config import TransferConfig
from kvplugins.transfer.rdma_paths import Path
from kvplugins.transfer.spans import SMALL

MAX_ROUTES = 256


class FastRoutes:
    """The native route table (module doc)."""

    def __init__(self, cfg: TransferConfig):
        self.native = verbs.fast_routes(cfg.rdma_max_wr, SMALL, cfg.rdma_signal_every, cfg.timeout_ms, MAX_ROUTES)

    def add_local(self, region: Region, lkeys: list[int]) -> None:
        self.native.add_local(region.region_id, region.addr, region.length, region.readonly, lkeys)

    def drop_local(self, region_id: int) -> None:
        """Waits for the fast batches in flight into or out of that region (its memory stays mapped until they
        completed)."""
        self.native.drop_local(region_id)

    def put(
        self,
        remote: SegmentDescriptor,
        region_id: int,
        qp: verbs.QueuePair,
        path: Path,
        raddr: int,
        rlength: int,
        rkey: int,
    ) -> None:
        """Route small batches to region ``region_id`` of ``remote`` (at ``raddr``, ``rlength`` bytes) over ``qp``."""
        self.native.put_route(
            remote, region_id, remote.segment_id, qp.qp, path.local, path.remote, raddr, rlength, rkey
        )  # fmt: skip

    def drop(self, seg: str) -> set[Path]:
        """Forget peer ``seg``'s routes; the paths they took."""
        return {Path(local, remote) for local, remote in self.native.drop_routes(seg)}

    def clear(self) -> None:
        self.native.clear()

    def counts(self) -> dict[str, int]:
        """Batches done here: reads, writes, entries (spans), bytes, wrs (work requests posted, failed ones too)."""
        return dict(zip(("reads", "writes", "entries", "bytes", "wrs"), self.native.counts()))
