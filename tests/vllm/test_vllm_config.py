"""Connector options: precedence and the embedded-store default (a real `kvplugins up --detach`)."""
from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]


def test_extra_config_beats_env(monkeypatch):
    from kvplugins.vllm_kv_connector import VllmConnectorConfig
    monkeypatch.setenv("KVPLUGINS_VLLM_RPC_TIMEOUT_MS", "250")
    monkeypatch.setenv("KVPLUGINS_VLLM_MASTER", "env-host:1")
    cfg = VllmConnectorConfig.from_extra_config({"master": "flag-host:2"})
    assert (cfg.master, cfg.rpc_timeout_ms) == ("flag-host:2", 250)


def test_bad_values_raise_clearly():
    from kvplugins.errors import ConfigError
    from kvplugins.vllm_kv_connector import VllmConnectorConfig
    with pytest.raises(ConfigError, match="retry_ms=0"):
        VllmConnectorConfig.from_extra_config({"retry_ms": 0})
    with pytest.raises(ConfigError, match="rpc_timeout_ms.*'soon'"):
        VllmConnectorConfig.from_extra_config({"rpc_timeout_ms": "soon"})


def test_no_master_uses_the_embedded_store(tmp_path, monkeypatch):
    from kvplugins.store import embedded
    from kvplugins.vllm_kv_connector import VllmConnectorConfig
    monkeypatch.setenv("KVPLUGINS_UP_DISCOVERY_FILE", str(tmp_path / "up.json"))
    client = VllmConnectorConfig.from_extra_config({}).client_factory()()
    try:
        assert client.master == embedded.discover()  # started by the factory, found through discovery
        client.put("k", b"v")
        assert client.get("k") == b"v"
    finally:
        client.close()
        info = embedded.read_discovery(tmp_path / "up.json")
        if info:
            os.kill(int(info["pid"]), signal.SIGTERM)
