"""vLLM config -> the engine-independent description kvplugins.layout needs (KeySpace, layer order)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvplugins.errors import ConfigError
from kvplugins.layout import KeySpace
from kvplugins.vllm_kv_connector.config import VllmConnectorConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def attention_group(kv_cache_config: "KVCacheConfig"):
    """The one full-attention KV cache group this connector serves. Raises ConfigError otherwise."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ConfigError(f"KVPluginsConnector supports one full-attention KV cache group; this model has {kinds}")
    return groups[0]


def keyspace(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cfg: VllmConnectorConfig,
             tp_rank: int = 0) -> KeySpace:
    """The KeySpace of TP rank ``tp_rank``: model, KV dtype, block size, layer names, TP, page bytes."""
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1:
        raise ConfigError(f"KVPluginsConnector: pipeline_parallel_size={par.pipeline_parallel_size} is not "
                          "supported yet; use 1")
    group = attention_group(kv_cache_config)
    spec = group.kv_cache_spec
    cache = vllm_config.cache_config
    return KeySpace(model=cfg.model_id or vllm_config.model_config.model,
                    kv_dtype=str(spec.dtype).removeprefix("torch."),
                    block_size=spec.block_size,
                    layer_group=",".join(group.layer_names),
                    tp_rank=tp_rank, tp_size=par.tensor_parallel_size,
                    page_bytes=spec.page_size_bytes * len(group.layer_names),
                    extra=f"hash={cache.prefix_caching_hash_algo};kv_quant={spec.kv_quant_mode}")


def hash_block_size(kv_cache_config: "KVCacheConfig", block_size: int) -> int:
    """Tokens per entry of request.block_hashes (vLLM may hash at a finer grain than its blocks)."""
    return kv_cache_config.hash_block_size or block_size
