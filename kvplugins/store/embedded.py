"""Embedded mode: ``kvplugins up`` runs the master and one segment in one process on 127.0.0.1 (ports 0) and
announces itself in a discovery file; adapters with no master address configured call ``discover()`` /
``ensure_running()`` to find (or start) it.

Discovery file: ``UpConfig.discovery_file`` (env KVPLUGINS_UP_DISCOVERY_FILE), else
``$XDG_RUNTIME_DIR/kvplugins/up.json``, else ``<tempdir>/kvplugins-<uid>/up.json``. JSON:
``{"master": "host:port", "zmq": "tcp://...", "pid": N, "segment": name}``; removed when ``up`` exits.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvplugins.config import load
from kvplugins.errors import MasterUnreachable, StoreError
from kvplugins.store.client.rpc import RawRpcClient
from kvplugins.store.config import UpConfig

SGLANG_FLAGS = (
    "--enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "
    '\'{"backend_name":"kvplugins","module_path":"kvplugins.sglang_hicache_backend",'
    '"class_name":"KVPluginsHiCacheStorage","interface_v1":1}\''
)
VLLM_FLAGS = (
    '--kv-transfer-config \'{"kv_connector":"KVPluginsConnector",'
    '"kv_connector_module_path":"kvplugins.vllm_kv_connector","kv_role":"kv_both"}\''
)
CLI = [sys.executable, "-c", "import sys; from kvplugins.cli import main; sys.exit(main())"]


def discovery_path(config: UpConfig | None = None) -> Path:
    """Where ``kvplugins up`` writes (and adapters read) the discovery file."""
    if config is None:
        config = load(UpConfig)
    if config.discovery_file:
        return Path(config.discovery_file)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvplugins" if runtime else Path(tempfile.gettempdir()) / f"kvplugins-{os.getuid()}"
    return base / "up.json"


def read_discovery(path: Path) -> dict | None:
    try:
        info = json.loads(path.read_text())
        os.kill(int(info["pid"]), 0)  # the process is alive
        return info
    except (OSError, ValueError, KeyError, TypeError):
        return None


def discover(timeout_ms: float = 1000, config: UpConfig | None = None) -> str | None:
    """Master address of a running, answering ``kvplugins up``, or None."""
    info = read_discovery(discovery_path(config))
    if info is None:
        return None
    rpc = RawRpcClient(info["master"], timeout_ms)
    try:
        rpc.call("info")
        return info["master"]
    except (MasterUnreachable, StoreError):
        return None
    finally:
        rpc.close()


def ensure_running(timeout_s: float = 30.0, config: UpConfig | None = None) -> str:
    """Master address of the embedded store, starting ``kvplugins up --detach`` if none runs (a file lock keeps
    concurrent callers from starting two). Raises MasterUnreachable if it is not ready within ``timeout_s``."""
    path = discovery_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        address = discover(config=config)
        if address:
            return address
        env = {**os.environ, "KVPLUGINS_UP_DISCOVERY_FILE": str(path)}
        try:
            proc = subprocess.run(
                CLI + ["up", "--detach", "--ready-timeout-ms", str(int(timeout_s * 1000))],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s + 5,
            )
        except subprocess.TimeoutExpired:
            proc = None
        address = discover(config=config)
        if address is None:
            detail = proc.stderr.strip()[-500:] if proc is not None else "timed out"
            raise MasterUnreachable(str(path), timeout_s * 1000, f"`kvplugins up --detach` failed: {detail}")
        return address


def wait_ready(path: Path, pid: int, timeout_s: float, alive) -> dict:
    """Wait until ``path`` names process ``pid`` (whose liveness ``alive()`` reports). Raises StoreError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = read_discovery(path)
        if info is not None and info.get("pid") == pid:
            return info
        if not alive():
            raise StoreError(f"`kvplugins up` (pid {pid}) exited before it was ready; see {path}.log")
        time.sleep(0.05)
    raise StoreError(f"`kvplugins up` (pid {pid}) not ready after {timeout_s:g} s; see {path}.log")


def flags_text(master: str) -> str:
    """The exact SGLang and vLLM flags that use this store."""
    return f"kvplugins store ready: master {master}\n\nSGLang:\n  {SGLANG_FLAGS}\n\nvLLM:\n  {VLLM_FLAGS}\n"


def resolve_master(address: str) -> str:
    """``address`` if given, else the running ``kvplugins up``'s. Raises StoreError naming the fix."""
    found = address or discover()
    if not found:
        raise StoreError("no master: pass --master HOST:PORT (or start `kvplugins up`)")
    return found
