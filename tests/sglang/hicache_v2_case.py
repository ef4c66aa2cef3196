"""A hybrid model's host pools as SGLang's HybridCacheController registers them (storage interface v2): the
KV anchor plus an SWA pool (a second MHA host pool) or a Mamba state pool (MambaPoolHost, one slot per page),
built on CPU like hicache_pools.py. Side-pool pages move through ``batch_set_v2`` / ``batch_get_v2`` with
``PoolTransfer`` lists shaped as the controller builds them (SWA: the window's last pages; Mamba: the state at
the last page), KV pages through ``batch_set_v1`` / ``batch_get_v1``. Call sglang_cpu.install() first."""

from __future__ import annotations

import ctypes
import hashlib

import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

import hicache_pools
from hicache_case import storage_config

PAGES, WINDOW, SLOTS = 6, 2, 8  # KV pages per prompt; SWA pages a hit needs; Mamba host slots


def mamba_pool(layers: int = 2) -> MambaPoolHost:
    temporal = torch.zeros(layers, SLOTS, 4, 8, dtype=torch.float32)
    conv = (torch.zeros(layers, SLOTS, 8, 3, dtype=torch.bfloat16),)
    with host_memory_budget_scope(64 << 20):
        return MambaPoolHost(
            MambaStateBufferInfo(temporal=temporal, conv=conv),
            host_to_device_ratio=2.0,
            host_size=0,
            device_capacity=SLOTS,
            pin_memory=False,
            device="cpu",
            layout="page_first",
        )


def make(master: str, side: str):
    """(backend, kv pool, side pool) for side "swa" or "mamba", attached as the hybrid controller does."""
    kv = hicache_pools.mha_pool("page_first")
    pool = hicache_pools.mha_pool("page_first", pages=8) if side == "swa" else mamba_pool()
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(master), kv)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(pool, PoolName.SWA if side == "swa" else PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend, kv, pool


def side_transfer(side: str, keys: list[str], placeholder: bool = False) -> PoolTransfer:
    """The side pool's transfer for a prompt with page keys ``keys``: its trailing pages, at fixed host slots
    (SWA: host pages 1..WINDOW; Mamba: slot 3). ``placeholder``: as a prefetch query builds it (keys carry N)."""
    n = WINDOW if side == "swa" else 1
    tail = ["__placeholder__"] * n if placeholder else keys[-n:]
    if side == "swa":
        idx = torch.arange(4, 4 + 4 * n, dtype=torch.int64)  # page size 4, host pages 1..n
        return PoolTransfer(PoolName.SWA, host_indices=idx, keys=tail, hit_policy=PoolHitPolicy.TRAILING_PAGES)
    return PoolTransfer(
        PoolName.MAMBA, host_indices=torch.tensor([3]), keys=tail, hit_policy=PoolHitPolicy.TRAILING_PAGES
    )


def kv_indices(pages: int = PAGES) -> torch.Tensor:
    return torch.arange(8, 8 + 4 * pages, dtype=torch.int64)  # host pages 2.. of the KV pool (page size 4)


def fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    kv = pool.kv_buffer
    for t in [kv] if torch.is_tensor(kv) else list(pool.get_hybrid_pool_buffer()):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def digests(pool, indices: torch.Tensor, step: int) -> list[str]:
    """sha256 of each page's bytes, read through the pool's own buffer metadata (any pool kind)."""
    out = []
    for i in range(0, indices.numel(), step):
        ptrs, sizes = pool.get_page_buffer_meta(indices[i : i + step])
        out.append(hashlib.sha256(b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))).hexdigest())
    return out
