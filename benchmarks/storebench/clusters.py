"""Each store's server processes, as context managers yielding a ``Target``: what writer and reader workers need
(backend name, server addresses, environment). Everything binds 127.0.0.1; everything is stopped on exit."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from storebench import netns
from machine import free_port
from storebench.procs import Worker, WorkerFailed, stop, wait_port

HOST = "127.0.0.1"
# Our transports per mode: ClientConfig.transports / StoreNodeConfig.transports (-> TransferConfig).
KVP_MODES = {"shm": "shm,tcp", "tcp": "tcp"}
# A get leases the object; the space of a removed object comes back when its lease ends. The benchmark's
# master uses a short lease (longer than a read of the largest batch at 0.25 GB/s) so removed rounds free their
# space soon (driver.SpaceGate waits for it, untimed); op timing does not depend on it. Mooncake's removals are
# forced (free at once).
MIN_LEASE_MS = 1000
KVP_RPC_TIMEOUT_MS = 10000


@dataclass(frozen=True)
class Target:
    """A running store: ``label`` names the table column (e.g. kvp-shm, mooncake-tcp)."""

    label: str
    store: str
    mode: str
    backend: str
    segment_bytes: int
    lease_ms: int
    cfg: dict
    env: dict = field(default_factory=dict)
    master_pid: int = 0  # the metadata server's process (master_memory.py reads its RSS)


def _bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        raise WorkerFailed(f"{name} not found next to {sys.executable} nor on PATH; see benchmarks/README.md")
    return found


@contextlib.contextmanager
def _popen(args: list[str], log: Path, env: dict) -> Iterator[subprocess.Popen]:
    with open(log, "ab") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        stop(proc)


def _wait_file(path: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The stripped text of ``path`` once ``proc`` wrote it; raises WorkerFailed if ``proc`` exits or on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise WorkerFailed(f"{' '.join(proc.args[:3])} exited rc={proc.returncode} before writing {path}")
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return text
        time.sleep(0.05)
    raise WorkerFailed(f"no port in {path} after {timeout_s:g} s")


@contextlib.contextmanager
def kvp(mode: str, max_batch: int, log_dir: Path) -> Iterator[Target]:
    """Our store: ``kvplugins master`` + one ``kvplugins store`` node holding the segment; the node and the
    clients offer the transports of ``mode`` (tcp: TCP forced, as TransferConfig(transports="tcp")).
    The segment also holds the rounds removed but still leased: 4 batches (>= 512 MiB)."""
    segment_bytes, lease_ms = max(512 << 20, 4 * max_batch), max(MIN_LEASE_MS, max_batch * 1000 // 250_000_000)
    transports, exe, env = KVP_MODES[mode], _bin("kvplugins"), dict(os.environ)
    port_file, ready_file = log_dir / f"kvp-{mode}-master.port", log_dir / f"kvp-{mode}-store.ready"
    for f in (port_file, ready_file):
        f.unlink(missing_ok=True)
    with _popen(
        [exe, "master", "--host", HOST, "--port", "0", "--port-file", str(port_file), "--lease-ttl-ms", str(lease_ms)],
        log_dir / f"kvp-{mode}-master.log",
        env,
    ) as master:
        addr = _wait_file(port_file, master)
        with _popen(
            [
                exe,
                "store",
                "--master",
                addr,
                "--segment-size",
                str(segment_bytes),
                "--host",
                HOST,
                "--transports",
                transports,
                "--ready-file",
                str(ready_file),
                "--rpc-timeout-ms",
                str(KVP_RPC_TIMEOUT_MS),
            ],
            log_dir / f"kvp-{mode}-store.log",
            env,
        ) as node:
            _wait_file(ready_file, node)
            cfg = {"master": addr, "transports": transports}
            yield Target(f"kvp-{mode}", "kvp", mode, "kvp", segment_bytes, lease_ms, cfg, env, master.pid)


@contextlib.contextmanager
def mooncake(max_batch: int, log_dir: Path) -> Iterator[Target]:
    """Mooncake: ``mooncake_master`` with its HTTP metadata server + one segment process, TCP protocol.
    Removals are forced, so the segment needs 2 batches (+ 64 MiB: eviction starts at 90 % use).
    Refuses to start outside a private network namespace (its servers bind 0.0.0.0)."""
    segment_bytes = 2 * max_batch + (64 << 20)
    if not netns.inside():
        raise SystemExit("refusing to start Mooncake outside a private network namespace; use --vs mooncake")
    rpc, http, metrics = free_port(), free_port(), free_port()
    env = dict(os.environ, MC_TCP_BIND_ADDRESS=HOST)
    args = [
        _bin("mooncake_master"),
        f"--rpc_port={rpc}",
        f"--rpc_address={HOST}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_port={http}",
        f"--http_metadata_server_host={HOST}",
        f"--metrics_port={metrics}",
        "--enable_metric_reporting=false",
    ]
    cfg = {"host": HOST, "master": f"{HOST}:{rpc}", "metadata": f"http://{HOST}:{http}/metadata"}
    with _popen(args, log_dir / "mooncake-master.log", env) as master:
        wait_port(HOST, rpc, 30, master)
        wait_port(HOST, http, 30, master)
        seg = Worker(
            "mooncake-segment",
            [
                "--backend",
                "mooncake",
                "--role",
                "segment",
                "--config",
                _json(cfg),
                "--segment-bytes",
                str(segment_bytes),
            ],
            env,
            log_dir,
        )
        try:
            yield Target("mooncake-tcp", "mooncake", "tcp", "mooncake", segment_bytes, 0, cfg, env, master.pid)
        finally:
            seg.close()


def _json(obj) -> str:
    import json

    return json.dumps(obj)
