"""Real store processes on loopback for tests: ``kvplugins master`` / ``store`` / ``up`` started on port 0, waited
for (port/ready/discovery file), yielded with their addresses, and killed on exit.

    with store_cluster(nodes=2, segment_size="8MiB", master_flags={"heartbeat_timeout_ms": 1000}) as c:
        StoreClient(ClientConfig(master=c.master)); c.nodes[0].kill()      # SIGKILL a node
    with master_process() as m: m.address
    with up_process(segment_size="8MiB") as u: u.address, u.discovery_file  (discovery file under a temp dir)

Processes run ``python -c "from kvplugins.cli import main; ..."`` (the ``kvplugins`` command) with this interpreter;
their output goes to a log file whose tail is included when one fails to start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvplugins.store.embedded import CLI

START_TIMEOUT_S = 20.0 * (6 if os.environ.get("KVPLUGINS_IN_GUEST") == "1" else 1)  # the TCG guest: ~10-50x slower


@dataclass
class Proc:
    """One started process. ``address``: master host:port (master/up) or segment name (store node)."""

    popen: subprocess.Popen
    log: Path
    address: str = ""
    discovery_file: Path | None = None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) and reap the process."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=10)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


@dataclass
class Cluster:
    master: str
    master_proc: Proc
    nodes: list[Proc] = field(default_factory=list)
    tmp: Path = Path(".")
    env: dict = field(default_factory=dict)

    def add_node(self, segment_size: str | int = "8MiB", **flags) -> Proc:
        """Start one more store node on this cluster's master; returns it once registered."""
        node = _start_node(self.master, segment_size, self.tmp, len(self.nodes), self.env, flags)
        self.nodes.append(node)
        return node


def _flags(flags: dict) -> list[str]:
    out = []
    for k, v in flags.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out


def _spawn(args: list[str], log: Path, env: dict) -> Proc:
    with open(log, "wb") as f:
        popen = subprocess.Popen(
            CLI + args, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Proc(popen, log)


def _wait_file(proc: Proc, path: Path, what: str) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if not proc.alive():
            raise RuntimeError(f"{what} exited with {proc.popen.returncode} before ready:\n{proc.log_tail()}")
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"{what} not ready after {START_TIMEOUT_S} s:\n{proc.log_tail()}")


def _env(tmp: Path) -> dict:
    return {**os.environ, "KVPLUGINS_UP_DISCOVERY_FILE": str(tmp / "up.json")}


def _start_master(tmp: Path, env: dict, flags: dict) -> Proc:
    port_file = tmp / "master.port"
    proc = _spawn(["master", "--port", "0", "--port-file", str(port_file)] + _flags(flags), tmp / "master.log", env)
    proc.address = _wait_file(proc, port_file, "kvplugins master")
    return proc


def _start_node(master: str, segment_size, tmp: Path, i: int, env: dict, flags: dict) -> Proc:
    ready = tmp / f"node{i}.ready"
    proc = _spawn(
        ["store", "--master", master, "--segment-size", str(segment_size), "--ready-file", str(ready)] + _flags(flags),
        tmp / f"node{i}.log",
        env,
    )
    proc.address = _wait_file(proc, ready, f"kvplugins store #{i}")
    return proc


@contextlib.contextmanager
def _tmpdir(tmp: Path | None):
    if tmp is not None:
        Path(tmp).mkdir(parents=True, exist_ok=True)
        yield Path(tmp)
    else:
        with tempfile.TemporaryDirectory(prefix="kvp-cluster-") as d:
            yield Path(d)


@contextlib.contextmanager
def master_process(tmp: Path | None = None, **flags):
    """A ``kvplugins master`` on 127.0.0.1:0 with MasterConfig ``flags`` (e.g. lease_ttl_ms=500). Yields Proc."""
    with _tmpdir(tmp) as d:
        proc = _start_master(d, _env(d), flags)
        try:
            yield proc
        finally:
            proc.kill()


@contextlib.contextmanager
def store_cluster(
    nodes: int = 1,
    segment_size: str | int = "8MiB",
    master_flags: dict | None = None,
    node_flags: dict | None = None,
    tmp: Path | None = None,
):
    """A master plus ``nodes`` store nodes of ``segment_size`` each. Yields a Cluster; kills all on exit."""
    with _tmpdir(tmp) as d:
        env = _env(d)
        master = _start_master(d, env, master_flags or {})
        cluster = Cluster(master.address, master, tmp=d, env=env)
        try:
            for _ in range(nodes):
                cluster.add_node(segment_size, **(node_flags or {}))
            yield cluster
        finally:
            for proc in cluster.nodes + [master]:
                proc.kill()


@contextlib.contextmanager
def up_process(segment_size: str | int = "8MiB", tmp: Path | None = None, **flags):
    """A foreground ``kvplugins up`` (master + one segment) whose discovery file lives in a temp dir.
    Yields Proc with .address and .discovery_file; sends SIGTERM (clean exit) then SIGKILL if needed."""
    with _tmpdir(tmp) as d:
        disc = d / "up.json"
        proc = _spawn(
            ["up", "--segment-size", str(segment_size), "--discovery-file", str(disc)] + _flags(flags),
            d / "up.log",
            _env(d),
        )
        proc.discovery_file = disc
        proc.address = json.loads(_wait_file(proc, disc, "kvplugins up"))["master"]
        try:
            yield proc
        finally:
            proc.kill(signal.SIGTERM)
