"""KVPluginsConnector overrides match the installed vLLM KVConnectorBase_V1 hook signatures."""

from __future__ import annotations

import inspect

import pytest
from helpers.installed import require

require("vllm", "bash ci/install.sh")
pytestmark = pytest.mark.vllm


def _shape(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_overridden_hooks_match_base_signatures():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvplugins.vllm_kv_connector import KVPluginsConnector

    overridden = [
        n
        for n, v in vars(KVPluginsConnector).items()
        if callable(v) and not n.startswith("__") and hasattr(KVConnectorBase_V1, n)
    ]
    assert {
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "register_kv_caches",
        "start_load_kv",
        "wait_for_save",
    } <= set(overridden)
    for name in overridden + ["__init__"]:
        assert _shape(getattr(KVPluginsConnector, name)) == _shape(getattr(KVConnectorBase_V1, name)), name


def test_no_abstract_hook_left():
    from kvplugins.vllm_kv_connector import KVPluginsConnector

    assert not getattr(KVPluginsConnector, "__abstractmethods__", None)


def test_unknown_extra_config_key_raises_clearly():
    from kvplugins.errors import ConfigError
    from kvplugins.vllm_kv_connector import VllmConnectorConfig

    with pytest.raises(ConfigError, match="unknown key.*mastr.*valid keys"):
        VllmConnectorConfig.from_extra_config({"mastr": "x:1"})
    assert VllmConnectorConfig.from_extra_config({"store": {"master": "h:1"}, "save": "false"}).save is False
