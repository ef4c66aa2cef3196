"""``kvplugins master``: the store's metadata master (kvplugins/store/master)."""

from __future__ import annotations

from kvplugins.config import add_arguments, from_args

COMMON = (
    "host",
    "port",
    "zmq_port",
    "metrics_port",
    "metrics_host",
    "etcd",
    "etcd_prefix",
    "events_port",
    "cluster",
    "shard",
    "port_file",
)  # listed first in --help


def add_parser(sub) -> None:
    from kvplugins.store.config import MasterConfig

    p = sub.add_parser("master", help="run the store master (object metadata, allocation, eviction)")
    add_arguments(p, MasterConfig, common=COMMON)
    p.add_argument("--config", help="TOML/JSON config file ([master] table)")


def run(args) -> int:
    from kvplugins.store.process import stop_on_signals, write_atomic
    from kvplugins.store.config import MasterConfig
    from kvplugins.store.master.rpc_server import RpcServer
    from kvplugins.store.master.shard import shard_defaults, start_shard

    cfg = shard_defaults(from_args(MasterConfig, args))
    if cfg.etcd:  # one of several masters; the etcd-elected one serves (store/master/ha)
        from kvplugins.store.master.ha.master import serve

        return serve(cfg)
    server = RpcServer(cfg)
    stop_on_signals(server.stop)
    shard = start_shard(cfg, server.address)
    server.service.shard = shard
    if cfg.port_file:
        write_atomic(cfg.port_file, server.address + "\n")
    print(
        f"kvplugins master: listening on {server.address} (control plane {server.zmq_endpoint})"
        + (f", shard {cfg.shard} of {cfg.cluster}" if shard else ""),
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        if shard is not None:
            shard.stop()
    return 0
