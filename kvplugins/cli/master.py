"""``kvplugins master``: the store's metadata master (kvplugins/store/master)."""
from __future__ import annotations

from kvplugins.config import add_arguments, from_args


def add_parser(sub) -> None:
    from kvplugins.store.config import MasterConfig
    p = sub.add_parser("master", help="run the store master (object metadata, allocation, eviction)")
    add_arguments(p, MasterConfig)
    p.add_argument("--config", help="TOML/JSON config file ([master] table)")


def run(args) -> int:
    from kvplugins.store.process import stop_on_signals, write_atomic
    from kvplugins.store.config import MasterConfig
    from kvplugins.store.master.rpc_server import RpcServer
    cfg = shard_defaults(from_args(MasterConfig, args))
    if cfg.etcd:                     # one of several masters; the etcd-elected one serves (store/ha)
        from kvplugins.store.ha.master import serve
        return serve(cfg)
    server = RpcServer(cfg)
    stop_on_signals(server.stop)
    shard = start_shard(cfg, server.address)
    server.service.shard = shard
    if cfg.port_file:
        write_atomic(cfg.port_file, server.address + "\n")
    print(f"kvplugins master: listening on {server.address} (control plane {server.zmq_endpoint})"
          + (f", shard {cfg.shard} of {cfg.cluster}" if shard else ""), flush=True)
    try:
        server.serve_forever()
    finally:
        if shard is not None:
            shard.stop()
    return 0


def shard_defaults(cfg):
    """An HA shard's etcd prefix defaults to <cluster prefix>/shard/<id> (its pair elects under it)."""
    import dataclasses

    from kvplugins.store.config import MasterConfig
    if cfg.shard and cfg.etcd and cfg.etcd_prefix == MasterConfig.etcd_prefix:
        from kvplugins.store.shard.cluster import parse
        cfg = dataclasses.replace(cfg, etcd_prefix=f"{parse(cfg.cluster)[1]}/shard/{cfg.shard}")
    return cfg


def start_shard(cfg, address: str):
    """The started shard role (kvplugins/store/shard/master.py) of a master with --shard, else None."""
    if not cfg.shard:
        return None
    from kvplugins.store.shard.master import ShardMember
    member = ShardMember(cfg.cluster, cfg.shard, address, cfg.shard_move_window_ms)
    member.start()
    return member
