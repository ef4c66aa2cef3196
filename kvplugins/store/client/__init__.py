"""The store's client room: ``StoreClient`` (store_client.py) and its parts: ``batches`` (a batch's spans as
arrays, grouped per segment and region), ``slab`` (client-reserved space: one round trip per put), ``stats``,
``checksum`` (xxh3_64 per object), ``rpc`` (the raw and zmq RPC clients) and ``connect`` (``master_client`` /
``control_client``: the one place a master address, plain, HA or sharded, becomes a client). Names load
lazily, so a master part that needs only ``rpc`` does not import the transfer engine."""

from __future__ import annotations

from kvplugins.lazy import lazy

__all__ = ["StoreClient", "master_client", "control_client"]
_LAZY = {
    "StoreClient": "kvplugins.store.client.store_client",
    "master_client": "kvplugins.store.client.connect",
    "control_client": "kvplugins.store.client.connect",
}

__getattr__ = lazy(__name__, _LAZY)
