"""``kvplugins master --etcd URL``: one of several masters of a cluster (``--etcd-prefix``); the elected one
serves, the others answer "not leader" and take over within about ``etcd_lease_ttl_ms`` when it dies."""

from __future__ import annotations

import json
import logging
import uuid

from kvplugins.store.cluster.etcd import Etcd, parse_endpoint
from kvplugins.store.master.ha.election import Elector
from kvplugins.store.master.ha.journal import EtcdJournal
from kvplugins.store.master.ha.leader import LeaderGuard
from kvplugins.store.master.rpc_server import RpcServer
from kvplugins.store.master.shard import start_shard
from kvplugins.store.process import stop_on_signals, write_atomic

log = logging.getLogger(__name__)


def serve(cfg) -> int:
    """Run an HA master until SIGTERM/SIGINT (a leader then hands over at once). Raises StoreError if etcd
    does not answer at start."""
    etcd = Etcd(cfg.etcd)
    etcd.get(cfg.etcd_prefix.rstrip("/") + "/leader")  # fail fast with a clear error if etcd is down
    journal = EtcdJournal(etcd, cfg.etcd_prefix)
    guard = LeaderGuard(cfg, journal, shard=start_shard(cfg, ha_address(cfg)))
    server = RpcServer(cfg, service=guard)
    value = json.dumps({"raw": server.address, "zmq": server.zmq_endpoint, "id": uuid.uuid4().hex}).encode()
    guard.elector = Elector(Etcd(cfg.etcd), journal.leader_key, value, cfg.etcd_lease_ttl_ms)  # own thread
    stop_on_signals(server.stop)
    if cfg.port_file:
        write_atomic(cfg.port_file, server.address + "\n")
    print(
        f"kvplugins master: listening on {server.address} (control plane {server.zmq_endpoint}), "
        f"HA via etcd {cfg.etcd} prefix {cfg.etcd_prefix}",
        flush=True,
    )
    guard.elector.start()
    try:
        server.serve_forever()
    finally:
        guard.elector.stop()
        if guard.shard is not None:
            guard.shard.stop()
    return 0


def ha_address(cfg) -> str:
    """The address clients dial to follow this cluster's leader: etcd://host:port[,host:port]/prefix."""
    endpoints, _ = parse_endpoint(cfg.etcd)
    return "etcd://" + ",".join(f"{h}:{p}" for h, p in endpoints) + cfg.etcd_prefix.rstrip("/")
