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
                    extra=f"hash={cache.prefix_caching_hash_algo};kv_quant={spec.kv_quant_mode};"
                          f"layout={physical_layout(vllm_config, kv_cache_config)}")


def physical_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> str:
    """How a page's bytes are arranged in memory: ``<attention backend>:<KV cache layout>``, e.g.
    ``CPU_ATTN:LBHNC`` or ``FLASH_ATTN:LBNHC`` (vLLM's KVCacheLayout names; the legacy NHD/HND aliases map to
    LBNHC/LBHNC). It is part of the key namespace, so two engines whose backends or layouts differ never read
    each other's pages as wrong bytes (they miss instead). The layout is the one the engine core resolved
    (``KVCacheConfig.kv_cache_layout``, else ``cache_config.kv_cache_layout``); before it is resolved, the
    backend's preferred layout. Source followed: vLLM 0.32 vllm/v1/kv_cache_layout.py and
    kv_connector/utils.get_current_attn_backend."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backend
    backend = get_current_attn_backend(vllm_config, attention_group(kv_cache_config).layer_names)
    name = getattr(kv_cache_config, "kv_cache_layout", None) or vllm_config.cache_config.kv_cache_layout
    if name is None:
        supported = backend.supported_kv_cache_layouts() or ()
        return f"{backend.get_name()}:{supported[0].name if supported else 'default'}"
    return f"{backend.get_name()}:{_LAYOUT_ALIASES.get(name, name)}"


_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vLLM's legacy names (config/cache.py)


def hash_block_size(kv_cache_config: "KVCacheConfig", block_size: int) -> int:
    """Tokens per entry of request.block_hashes (vLLM may hash at a finer grain than its blocks)."""
    return kv_cache_config.hash_block_size or block_size
