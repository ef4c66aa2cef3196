"""kvplugins.p2p: Mooncake's P2P Store model on the transfer core: objects (e.g. a checkpoint's files) shared
between peers with no master, a catalog in etcd, every peer that pulled an object serving it on, so one
publisher's egress is never the bottleneck. Rooms: ``config`` (P2PConfig), ``catalog`` (the etcd records, typed
and checked), ``pull`` (one get_replica: chunk and peer choice, verification), ``store`` (P2PStore, the
lifecycle), ``checkpoint`` (a safetensors directory as an object, for ``kvplugins p2p``). docs/p2p.md."""

from kvplugins.lazy import lazy

__all__ = ["P2PConfig", "P2PStore", "PayloadInfo", "PullStats"]

__getattr__ = lazy(
    __name__,
    {
        "P2PConfig": "kvplugins.p2p.config",
        "P2PStore": "kvplugins.p2p.store",
        "PayloadInfo": "kvplugins.p2p.store",
        "PullStats": "kvplugins.p2p.pull",
    },
)
