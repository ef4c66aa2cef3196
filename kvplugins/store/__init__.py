"""The store: a Mooncake-style pool of DRAM segments (docs/store.md).

master/      metadata master (object table, allocator, eviction, segment registry, RPC endpoints)
node.py      a store node contributing one segment; client.py the StoreClient; embedded.py `kvplugins up`.
Names load lazily so ``import kvplugins.store`` stays cheap (no zmq, no transfer engine).
"""
from __future__ import annotations

_LAZY = {"StoreClient": "kvplugins.store.client", "ClientConfig": "kvplugins.store.config",
         "MasterConfig": "kvplugins.store.config", "StoreNodeConfig": "kvplugins.store.config",
         "UpConfig": "kvplugins.store.config"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvplugins.store' has no attribute {name!r}")
