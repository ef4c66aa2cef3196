"""Embedded mode with real processes: `kvplugins up` (flags printed, discovery file written and removed),
discover()/ensure_running() (auto-start detached), a client with no master address, and `kvplugins status`."""

import json
import os
import signal
import subprocess
import time

from helpers.cluster import up_process
from kvplugins.store import ClientConfig, StoreClient, embedded
from kvplugins.store.config import UpConfig


def test_up_prints_flags_serves_and_cleans_up(tmp_path, monkeypatch):
    with up_process(segment_size="4MiB", tmp=tmp_path) as up:
        out = up.log_tail(5000)
        assert embedded.SGLANG_FLAGS in out and embedded.VLLM_FLAGS in out
        assert embedded.discover(config=UpConfig(discovery_file=str(up.discovery_file))) == up.address
        monkeypatch.setenv("KVPLUGINS_UP_DISCOVERY_FILE", str(up.discovery_file))
        with StoreClient(ClientConfig(master="")) as c:  # no address: discovered
            assert c.master == up.address
            c.put("emb/a", b"hello" * 100)
            assert c.get("emb/a") == b"hello" * 100
        status = subprocess.run(
            embedded.CLI + ["status"], capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "200"}
        )
        assert status.returncode == 0, status.stderr
        assert "segment" in status.stdout and "objects 1" in status.stdout and "hits 1" in status.stdout
    assert not up.discovery_file.exists()  # removed on SIGTERM
    assert up.popen.returncode == 0


def test_ensure_running_starts_one_detached_up(tmp_path):
    cfg = UpConfig(discovery_file=str(tmp_path / "up.json"))
    assert embedded.discover(config=cfg) is None
    address = embedded.ensure_running(timeout_s=20, config=cfg)
    pid = json.loads((tmp_path / "up.json").read_text())["pid"]
    try:
        assert embedded.ensure_running(timeout_s=20, config=cfg) == address  # found, not started twice
        with StoreClient(ClientConfig(master=address)) as c:
            c.put("det/a", b"x")
            assert c.exists("det/a")
    finally:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while (tmp_path / "up.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (tmp_path / "up.json").exists() and embedded.discover(config=cfg) is None


def test_stale_discovery_file_is_ignored(tmp_path):
    path = tmp_path / "up.json"
    path.write_text(json.dumps({"master": "127.0.0.1:1", "pid": 2**22 + 12345}))
    assert embedded.discover(config=UpConfig(discovery_file=str(path))) is None
