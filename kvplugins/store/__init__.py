"""The store: a Mooncake-style pool of DRAM segments (docs/store.md).

wire/        the protocol and typed request/reply schemas every room shares
client/      StoreClient and its parts, the RPC clients, the address -> client factory (connect.py)
master/      metadata master (object table, allocator, eviction, segment registry, RPC endpoints)
node/        a store node contributing one segment (and the segment a client may contribute)
disk/, ha/, shard/   the disk tier, HA on etcd, hash-sharded masters; embedded.py `kvplugins up`.
Names load lazily so ``import kvplugins.store`` stays cheap (no zmq, no transfer engine).
"""

from __future__ import annotations

from kvplugins.lazy import lazy

_LAZY = {
    "StoreClient": "kvplugins.store.client",
    "ClientConfig": "kvplugins.store.config",
    "MasterConfig": "kvplugins.store.config",
    "StoreNodeConfig": "kvplugins.store.config",
    "UpConfig": "kvplugins.store.config",
}
__all__ = list(_LAZY)

__getattr__ = lazy(__name__, _LAZY)
