"""Connector options: precedence and the embedded-store default (a real `kvplugins up --detach`)."""

from __future__ import annotations

import os
import signal

import pytest
from helpers.installed import require

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]


def test_extra_config_beats_env(monkeypatch):
    from kvplugins.vllm_kv_connector import VllmConnectorConfig

    monkeypatch.setenv("KVPLUGINS_CLIENT_RPC_TIMEOUT_MS", "250")
    monkeypatch.setenv("KVPLUGINS_CLIENT_MASTER", "env-host:1")
    monkeypatch.setenv("KVPLUGINS_VLLM_RETRY_MS", "77")
    cfg = VllmConnectorConfig.from_extra_config({"store": {"master": "flag-host:2"}})
    assert (cfg.store.master, cfg.store.rpc_timeout_ms, cfg.retry_ms) == ("flag-host:2", 250, 77)


def test_the_store_section_is_a_client_config_with_the_documented_precedence(tmp_path, monkeypatch):
    """flag > env (KVPLUGINS_CLIENT_*) > file ([vllm.store] over [client]) > the connector's own defaults
    (rpc_timeout_ms 1000) > ClientConfig's."""
    from kvplugins.vllm_kv_connector import VllmConnectorConfig

    assert VllmConnectorConfig.from_extra_config({}).store.rpc_timeout_ms == 1000
    f = tmp_path / "kvp.toml"
    f.write_text(
        "[client]\nrpc_timeout_ms = 111\nreplicas = 2\ntransfer_timeout_ms = 5\n"
        '[vllm.store]\ntransfer_timeout_ms = 222\nmaster = "file:1"\n'
    )
    monkeypatch.setenv("KVPLUGINS_CONFIG", str(f))
    cfg = VllmConnectorConfig.from_extra_config({}).store
    assert (cfg.rpc_timeout_ms, cfg.replicas, cfg.transfer_timeout_ms, cfg.master) == (111, 2, 222, "file:1")
    monkeypatch.setenv("KVPLUGINS_CLIENT_TRANSFER_TIMEOUT_MS", "333")
    cfg = VllmConnectorConfig.from_extra_config({"store": {"master": "flag:2"}}).store
    assert (cfg.transfer_timeout_ms, cfg.master) == (333, "flag:2")


def test_bad_values_raise_clearly():
    from kvplugins.errors import ConfigError
    from kvplugins.vllm_kv_connector import VllmConnectorConfig

    with pytest.raises(ConfigError, match="retry_ms=0"):
        VllmConnectorConfig.from_extra_config({"retry_ms": 0})
    with pytest.raises(ConfigError, match="rpc_timeout_ms.*'soon'"):
        VllmConnectorConfig.from_extra_config({"store": {"rpc_timeout_ms": "soon"}})
    with pytest.raises(ConfigError, match='master belong in the store section: write {"store": {"master"'):
        VllmConnectorConfig.from_extra_config({"master": "h:1"})
    with pytest.raises(ConfigError, match="KVPLUGINS_VLLM_STORE_MASTER.*KVPLUGINS_CLIENT_<SETTING>"):
        from kvplugins.config import load

        load(VllmConnectorConfig, environ={"KVPLUGINS_VLLM_STORE_MASTER": "h:1"})


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
