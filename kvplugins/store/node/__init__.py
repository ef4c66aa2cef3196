"""The store's node room: ``StoreNode`` (store_node.py: a process contributing one DRAM segment, with its
heartbeats and command link) and ``segment`` (``OwnedSegment``: the segment, its registration and heartbeats,
used by StoreNode and by a client that contributes a segment). The disk tier under it: node/disk/; its DRAM
over a sharded store's masters: extents.py."""

from __future__ import annotations

from kvplugins.lazy import lazy

__all__ = ["StoreNode", "OwnedSegment", "serve"]
_LAZY = {
    "StoreNode": "kvplugins.store.node.store_node",
    "serve": "kvplugins.store.node.store_node",
    "OwnedSegment": "kvplugins.store.node.segment",
}

__getattr__ = lazy(__name__, _LAZY)
