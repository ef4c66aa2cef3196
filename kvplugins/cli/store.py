"""``kvplugins store``: a store node contributing one DRAM segment (kvplugins/store/node/store_node.py), optionally with a
disk tier (``--disk-dir``, ``--disk-capacity``); ``kvplugins store --drain --segment NAME`` drains a running node
(kvplugins/store/node/disk/drain.py) and exits when it has left."""

from __future__ import annotations

import threading

from kvplugins.config import add_arguments, from_args

COMMON = (
    "master",
    "segment_size",
    "host",
    "disk_dir",
    "disk_capacity",
    "metrics_port",
    "drain",
    "segment",
)  # first in --help


def add_parser(sub) -> None:
    from kvplugins.store.config import StoreNodeConfig

    p = sub.add_parser("store", help="contribute a DRAM segment to the pool of a master (or --drain one)")
    add_arguments(p, StoreNodeConfig, common=COMMON)
    p.add_argument("--config", help="TOML/JSON config file ([store] table)")


def run(args) -> int:
    from kvplugins.store import embedded
    from kvplugins.store.node import store_node as node
    from kvplugins.store.config import StoreNodeConfig
    from kvplugins.store.process import stop_on_signals

    cfg = from_args(StoreNodeConfig, args)
    master = embedded.resolve_master(cfg.master)
    if cfg.drain:
        from kvplugins.store.node.disk.drain import drain

        drain(master, cfg.segment, cfg.drain_timeout_ms, cfg.rpc_timeout_ms)
        return 0
    stop = threading.Event()
    stop_on_signals(stop.set)
    node.serve(cfg, master, stop)
    return 0
