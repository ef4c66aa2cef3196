"""A store node: one process contributing ``segment_size`` bytes of DRAM to the pool (``kvplugins store``).

The segment lives in this process's TransferEngine (alloc_shared, exported); clients read and write it directly
through the transfer core — the master only hands out offsets. Registration and heartbeats use the master's
zmq control plane (the ``info`` op on the master address names it). The node's disk tier and drain commands
run in a NodeTier (kvplugins/store/node/disk/worker.py) polling the master's raw endpoint.
"""

from __future__ import annotations

import logging
import threading

from kvplugins.store.client.connect import control_client
from kvplugins.store.config import StoreNodeConfig
from kvplugins.store.metrics import serve_node
from kvplugins.store.node.disk.worker import NodeTier
from kvplugins.store.node.extents import ShardedSegments
from kvplugins.store.node.segment import OwnedSegment
from kvplugins.store.process import write_atomic
from kvplugins.transfer import TransferEngine
from kvplugins.transfer.config import transfer_config

log = logging.getLogger(__name__)


class StoreNode:
    """Start the transfer engine, allocate and register the segment, start the disk tier / drain worker.
    ``master``: raw address host:port; ``on_drained()`` is called once the master drained this node.
    Raises MasterUnreachable if the master does not answer within ``rpc_timeout_ms``."""

    def __init__(self, config: StoreNodeConfig, master: str, on_drained=lambda: None):
        self.cfg, self.master = config, master
        self.engine = TransferEngine(transfer_config(host=config.host, transports=config.transports))
        self.segment = self.tier = self._rpc = None
        if master.startswith("shards://"):  # extents over the shards' masters (node/extents.py)
            try:
                self.segment = ShardedSegments(self.engine, master, config.segment_size, config.shard_extents, config)
            except BaseException:
                self.engine.close()
                raise
            if config.ready_file:
                write_atomic(config.ready_file, self.segment.name + "\n")
            return
        try:
            self._rpc = control_client(master, config.rpc_timeout_ms, "node")
            self.segment = OwnedSegment(
                self.engine, config.segment_size, self._rpc, config.heartbeat_interval_ms, prefault=config.prefault
            )
            self.tier = NodeTier(config, self.engine, self.segment, master, on_drained)
        except BaseException:
            self.close()
            raise
        if config.ready_file:
            write_atomic(config.ready_file, self.segment.name + "\n")

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
        if self.segment is not None:
            self.segment.close()
        if self._rpc is not None:
            self._rpc.close()
        self.engine.close()


def serve(config: StoreNodeConfig, master: str, stop: threading.Event) -> None:
    """Run a node until ``stop`` is set (a signal, or the master drained it)."""
    node = StoreNode(config, master, on_drained=stop.set)
    disk = f", disk tier {config.disk_dir} ({config.disk_capacity} bytes)" if config.disk_dir else ""
    print(
        f"kvplugins store: segment {node.segment.name} ({config.segment_size} bytes{disk}) -> master {master}",
        flush=True,
    )
    exporter = serve_node(node, config)  # /metrics if metrics_port >= 0
    try:
        while not stop.wait(0.5):  # short waits keep signal handlers responsive
            pass
    finally:
        if exporter is not None:
            exporter.close()
        node.close()
