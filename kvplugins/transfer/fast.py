"""What the TCP and cma small-batch tables share on the Python side (tcp_fast.py, cma_fast.py; rdma_fast.py has its
lkeys and work requests on top): the registered local regions, dropping a peer's routes, the counters.

Every table's ``native.read`` / ``native.write`` take ``(remote, region, laddr, roff, length, timeout_ms=None,
digests=None)`` as TransferEngine.read_spans passes them and return the spans done, 0 where the table cannot take
the batch (nothing moved), or -1 when it failed there (the engine then calls the transport's ``fast_failed`` and
runs the batch its general way).
"""

from __future__ import annotations

from typing import Any

from kvplugins.transfer.api import Region


class FastTable:
    """A native route table ``native`` (module doc)."""

    native: Any

    def add_local(self, region: Region) -> None:
        self.native.add_local(region.region_id, region.addr, region.length, region.readonly)

    def drop_local(self, region_id: int) -> None:
        """Waits for the fast batches in flight into or out of that region."""
        self.native.drop_local(region_id)

    def drop(self, seg: str) -> None:
        """Forget peer ``seg``'s routes."""
        self.native.drop_routes(seg)

    def clear(self) -> None:
        self.native.clear()

    def counts(self) -> dict[str, int]:
        """Batches done here: reads, writes, entries (spans), bytes."""
        return dict(zip(("reads", "writes", "entries", "bytes"), self.native.counts()))
