"""Real SGLang host KV pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost) built on CPU from CPU "device" buffers,
as SGLang's pool assembler builds them on a GPU machine (a GPU cannot exist here: the device side is CPU tensors).
Built inside SGLang's ``host_memory_budget_scope`` with a budget of exactly the pool's bytes, as a launcher that
sized the pool explicitly does: SGLang's own free-RAM check keeps a multi-GB reserve that this shared CI
machine does not always have. Import sglang_cpu.install() before this module.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

CPU = torch.device("cpu")


def _ptrs(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(
    layout: str,
    layers: int = 4,
    heads: int = 2,
    head_dim: int = 16,
    page_size: int = 4,
    pages: int = 16,
    dtype=torch.bfloat16,
) -> MHATokenToKVPoolHost:
    """An MHA host pool of ``pages`` pages (+1 padding page SGLang reserves) in ``layout``."""
    dev_tokens = pages * page_size
    k = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=CPU,
    )
    with host_memory_budget_scope((pages + 1) * page_size * 2 * layers * heads * head_dim * dtype.itemsize):
        return MHATokenToKVPoolHost(
            info,
            host_to_device_ratio=1.0,
            host_size=0,
            page_size=page_size,
            layout=layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=dev_tokens,
            start_layer=0,
            end_layer=layers - 1,
            host_token_capacity=(pages + 1) * page_size,
        )


def mla_pool(
    layout: str,
    layers: int = 4,
    kv_lora_rank: int = 32,
    rope_dim: int = 8,
    page_size: int = 4,
    pages: int = 16,
    dtype=torch.bfloat16,
) -> MLATokenToKVPoolHost:
    """An MLA host pool (one latent row of kv_lora_rank + rope_dim per token and layer) in ``layout``."""
    dev_tokens = pages * page_size
    dim = kv_lora_rank + rope_dim
    bufs = tuple(torch.zeros(dev_tokens, 1, dim, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=_ptrs(bufs),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        kv_cache_dim=dim,
        dtype=dtype,
        device=CPU,
    )
    with host_memory_budget_scope((pages + 1) * page_size * layers * dim * dtype.itemsize):
        return MLATokenToKVPoolHost(
            info,
            host_to_device_ratio=1.0,
            host_size=0,
            page_size=page_size,
            layout=layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=dev_tokens,
            start_layer=0,
            end_layer=layers - 1,
            target_layer_num=layers,
            host_token_capacity=(pages + 1) * page_size,
        )
