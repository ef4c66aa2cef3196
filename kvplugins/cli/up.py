"""``kvplugins up``: the master and one DRAM segment in one process on 127.0.0.1 (embedded mode).

Writes the discovery file (kvplugins/store/embedded.py), prints the SGLang and vLLM flags, serves until
SIGTERM/SIGINT and removes the discovery file on exit. ``--detach`` starts it in the background and returns
once it is ready.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading

from kvplugins.config import add_arguments, from_args

NODE_SKIP = (
    "master",
    "host",
    "ready_file",
    "metrics_port",
    "metrics_host",
    "metrics_max_connections",
    "metrics_max_connections_per_peer",
    "metrics_timeout_ms",  # one endpoint: the master's
    "drain",
    "segment",
    "drain_timeout_ms",
)  # `kvplugins store --drain`'s, not up's


def _classes():
    from kvplugins.store.config import MasterConfig, StoreNodeConfig, UpConfig

    return MasterConfig, StoreNodeConfig, UpConfig


def add_parser(sub) -> None:
    master, node, up = _classes()
    p = sub.add_parser("up", help="run master + one segment in one process; print the SGLang/vLLM flags")
    add_arguments(p, up)
    add_arguments(p, node, skip=NODE_SKIP, common=("segment_size", "disk_dir", "disk_capacity"))
    add_arguments(p, master, common=("host", "port", "metrics_port", "events_port"))
    p.add_argument("--config", help="TOML/JSON config file ([master], [store], [up] tables)")


def run(args) -> int:
    from kvplugins.store import embedded

    master_cls, node_cls, up_cls = _classes()
    up = from_args(up_cls, args)
    path = embedded.discovery_path(up)
    running = embedded.discover(config=up)
    if running:
        print(embedded.flags_text(running) + f"(already running; discovery file {path})", flush=True)
        return 0
    if up.detach:
        return _detach(args, up, path)
    return _serve(from_args(master_cls, args), from_args(node_cls, args), path)


def _serve(mcfg, ncfg, path) -> int:
    from kvplugins.store import embedded
    from kvplugins.store.master.rpc_server import RpcServer
    from kvplugins.store.node.store_node import StoreNode
    from kvplugins.store.process import stop_on_signals, write_atomic

    server = RpcServer(mcfg)
    loop = threading.Thread(target=server.serve_forever, name="kvp-master", daemon=True)
    loop.start()
    stop = threading.Event()
    stop_on_signals(stop.set)
    node = StoreNode(ncfg, server.address)
    node_metrics = _attach_metrics(server, node)
    try:
        write_atomic(
            path,
            json.dumps(
                {"master": server.address, "zmq": server.zmq_endpoint, "pid": os.getpid(), "segment": node.segment.name}
            ),
        )
        if mcfg.port_file:
            write_atomic(mcfg.port_file, server.address + "\n")
        metrics = f"; metrics {server.metrics.endpoint.url}" if server.metrics.endpoint else ""
        print(embedded.flags_text(server.address) + f"(discovery file {path}{metrics})", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        if node_metrics is not None:
            node_metrics.close()
        node.close()
        server.stop()
        loop.join(timeout=5)
        if (embedded.read_discovery(path) or {}).get("pid") == os.getpid():
            path.unlink(missing_ok=True)
    return 0


def _attach_metrics(server, node):
    """The node's series on the master's endpoint (one /metrics for the whole `up` process), if enabled."""
    if server.metrics.endpoint is None:
        return None
    from kvplugins.store.metrics import NodeMetrics

    nm = NodeMetrics(node, server.address)
    nm.attach(server.metrics.endpoint)
    return nm


def _detach(args, up, path) -> int:
    from kvplugins.store import embedded

    argv = embedded.CLI + ["--log-level", args.log_level, "up"] + _given_flags(args) + ["--no-detach"]
    argv += ["--discovery-file", str(path)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.log", "ab") as log:
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    info = embedded.wait_ready(path, child.pid, up.ready_timeout_ms / 1000, lambda: child.poll() is None)
    print(embedded.flags_text(info["master"]) + f"(pid {child.pid}; discovery file {path}; log {path}.log)", flush=True)
    return 0


def _given_flags(args) -> list[str]:
    """The config flags given on this command line, to hand to the detached child."""
    out = []
    names = {f.name for cls in _classes() for f in dataclasses.fields(cls)} - {"detach", "discovery_file"}
    for name in sorted(names):
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            out += [flag, str(value)]
    if getattr(args, "config", None):
        out += ["--config", args.config]
    return out
