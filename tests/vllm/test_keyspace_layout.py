"""The key namespace names the attention backend's physical KV layout: engines whose KV bytes are arranged
differently (vLLM's KVCacheLayout, e.g. LBNHC = NHD vs LBHNC = HND, or another backend) never share pages.
A real VllmConfig of the demo model (vLLM's own EngineArgs) and real KVCacheConfig objects as the engine core
builds them; only the layout differs. GPU backends cannot be selected on this CPU-only host, so the backend part
is the CPU one here (CPU_ATTN); the layout part is what a GPU engine resolves to as well."""

from __future__ import annotations

import pytest
from helpers.installed import require

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def vllm_config(model):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model, dtype="float32", block_size=32, enforce_eager=True, max_model_len=2048
    ).create_engine_config()


def kv_cache_config(layout: str | None):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_layout=layout,
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )


def test_layouts_get_different_namespaces(vllm_config):
    from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
    from kvplugins.vllm_kv_connector.engine import keyspace

    cfg = VllmConnectorConfig.from_extra_config({"store": {"master": "unused:1"}})
    nhd, hnd, hnd_alias, nhd_alias = (
        keyspace(vllm_config, kv_cache_config(x), cfg) for x in ("LBNHC", "LBHNC", "HND", "NHD")
    )
    assert nhd.page_bytes == hnd.page_bytes  # same size, different byte order: only the namespace tells them apart
    assert nhd.namespace != hnd.namespace
    assert hnd.namespace == hnd_alias.namespace and nhd.namespace == nhd_alias.namespace  # legacy names
    assert hnd.extra.endswith(";layout=CPU_ATTN:LBHNC") and nhd.extra.endswith(";layout=CPU_ATTN:LBNHC")


def test_unresolved_layout_is_the_backends_preferred_one(vllm_config):
    """Before the engine core resolves it, the layout is the backend's first supported one (CPU: LBHNC), so a
    connector built early agrees with one built after resolution."""
    from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
    from kvplugins.vllm_kv_connector.engine import keyspace

    cfg = VllmConnectorConfig.from_extra_config({"store": {"master": "unused:1"}})
    assert (
        keyspace(vllm_config, kv_cache_config(None), cfg).namespace
        == keyspace(vllm_config, kv_cache_config("LBHNC"), cfg).namespace
    )
