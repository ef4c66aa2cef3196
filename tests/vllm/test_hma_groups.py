"""vLLM's hybrid memory allocator, driven with vLLM's own KV cache specs (no engine): the connector declares
SupportsHMA (so MultiConnector keeps HMA on with it), reads full-attention and sliding-window groups with the hit
rule of vLLM's prefix cache, takes Mamba / linear-attention state groups in "align" mode (one state page at the
hit's end) and refuses other modes and kinds with a clear error."""

from __future__ import annotations

import pytest
from helpers.installed import require

require("vllm", "bash ci/install.sh")


@pytest.fixture(scope="module")
def vllm_config(model):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model, dtype="float32", block_size=32, enforce_eager=True, max_model_len=2048
    ).create_engine_config()


def _config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec) for i, spec in enumerate(specs)],
    )


def _attn(window: int | None = None):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kw = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return SlidingWindowSpec(**kw, sliding_window=window) if window else FullAttentionSpec(**kw)


def test_multiconnector_keeps_hma_with_this_connector():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from kvplugins.vllm_kv_connector.connector import KVPluginsConnector
    from kvplugins.vllm_kv_connector.plugin import register

    register()
    assert supports_hma(KVPluginsConnector)
    ktc = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [{"kv_connector": "KVPluginsConnector", "kv_role": "kv_both"}]},
    )
    assert MultiConnector.all_children_support_hma(ktc)


def test_sliding_window_group_needs_only_the_window_before_the_hit_end():
    from kvplugins.vllm_kv_connector.engine import groups

    full, sliding = groups(_config(_attn(), _attn(window=128)))
    assert (full.window_blocks, sliding.window_blocks) == (0, 4)  # vLLM: cdiv(128 - 1, 32)
    assert list(full.needed(2, 10)) == list(range(2, 10))
    assert list(sliding.needed(2, 10)) == [6, 7, 8, 9]
    assert list(sliding.needed(2, 4)) == [2, 3]  # a local hit covers pages [0, 2)
    assert list(groups(_config(_attn(window=33)))[0].needed(0, 10)) == [9]  # cdiv(33 - 1, 32) = 1 page


def test_keyspaces_of_two_groups_never_share_a_key(vllm_config):
    from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
    from kvplugins.vllm_kv_connector.engine import groups, keyspace

    kv = _config(_attn(), _attn(window=128))
    cfg = VllmConnectorConfig.from_extra_config({"store": {"master": "unused:1"}})
    a, b = (keyspace(vllm_config, kv, cfg, group=g) for g in groups(kv))
    assert a.namespace != b.namespace and a.keys([b"\x01" * 32]) != b.keys([b"\x01" * 32])


def test_mamba_state_group_in_align_mode_needs_only_the_hit_end(vllm_config):
    """vLLM's MambaManager hits on the state at the hit's last block; the state page is the state's bytes
    without vLLM's page padding; outside "align" mode (no per-block states) the group is refused with the fix."""
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec

    from kvplugins.errors import ConfigError
    from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
    from kvplugins.vllm_kv_connector.engine import groups, keyspace

    shapes, dtypes = ((3, 256), (4, 8, 16)), (torch.float32, torch.bfloat16)
    mamba = MambaSpec(block_size=32, shapes=shapes, dtypes=dtypes, page_size_padded=1 << 16, mamba_cache_mode="align")
    full, state = groups(_config(_attn(), mamba))
    assert state.state and not full.state and list(state.needed(2, 10)) == [9] and not list(state.needed(2, 2))
    ks = keyspace(
        vllm_config,
        _config(_attn(), mamba),
        VllmConnectorConfig.from_extra_config({"store": {"master": "x:1"}}),
        group=state,
    )
    assert ks.page_bytes == 3 * 256 * 4 + 4 * 8 * 16 * 2 and "float32,bfloat16" in ks.kv_dtype
    with pytest.raises(ConfigError, match="group 1 .*mamba_cache_mode='none'.*enable-prefix-caching"):
        groups(_config(_attn(), MambaSpec(block_size=32, shapes=shapes, dtypes=dtypes)))
    local = ChunkedLocalAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, attention_chunk_size=64
    )
    with pytest.raises(ConfigError, match="group 1: ChunkedLocalAttentionSpec"):
        groups(_config(_attn(), local))


def test_layer_chunks_cut_a_group_into_consecutive_layers_with_their_own_keys(vllm_config):
    """layer_chunks: one page becomes several objects of consecutive layers (same block ids, own keys); 1 keeps
    the one-object keys."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
    from kvplugins.vllm_kv_connector.engine import groups, keyspace

    names = [f"model.layers.{i}.self_attn.attn" for i in range(5)]
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, _attn())])
    chunks = groups(kv, layer_chunks=2)
    assert [c.layer_names for c in chunks] == [tuple(names[:3]), tuple(names[3:])]
    assert [(c.index, c.uid) for c in chunks] == [(0, 0), (0, 1)]
    assert [c.layer_names for c in groups(kv, layer_chunks=9)] == [(n,) for n in names]  # at most one per layer
    cfg = VllmConnectorConfig.from_extra_config({"store": {"master": "unused:1"}})
    whole, *parts = [keyspace(vllm_config, kv, cfg, group=g) for g in groups(kv) + chunks]
    assert len({whole.namespace, *(p.namespace for p in parts)}) == 3
    assert sum(p.page_bytes for p in parts) == whole.page_bytes
    with pytest.raises(Exception, match="layer_chunks=0"):
        VllmConnectorConfig.from_extra_config({"layer_chunks": 0})
