"""One HiCache test case as SGLang runs it: the backend built by StorageBackendFactory from the user's JSON,
attached to a real CPU host pool the way ``HiCacheController.attach_storage_backend`` does, and pages moved by
the controller's own page IO helpers (``_page_set_zero_copy`` / ``_page_get_zero_copy`` with interface_v1,
``_generic_page_set`` / ``_generic_page_get`` without). Shared by the tests and hicache_worker.py.
Call sglang_cpu.install() before importing this module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory

import hicache_pools

USER_JSON = {
    "backend_name": "kvplugins",
    "module_path": "kvplugins.sglang_hicache_backend",
    "class_name": "KVPluginsHiCacheStorage",
    "interface_v1": 1,
}
MHA_LAYOUTS = ("page_first", "page_first_direct", "layer_first", "page_head")
MLA_LAYOUTS = ("page_first", "page_first_direct", "layer_first")
PAGES = 6  # pages written per case
FIRST = 2  # first host page used (page 0 is never special-cased)


def storage_config(
    master: str | None,
    *,
    kind: str = "mha",
    tp_rank: int = 0,
    tp_size: int = 1,
    v1: bool = True,
    model: str = "test/model",
    **extra,
) -> HiCacheStorageConfig:
    """The HiCacheStorageConfig SGLang builds for one rank; master None = the user's JSON names no master."""
    cfg = {**USER_JSON, "interface_v1": int(v1), "retry_ms": 200, **extra}
    if master is not None:
        cfg["store"] = {"master": master}
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=kind == "mla",
        enable_storage_metrics=True,
        is_page_first_layout=True,
        model_name=model,
        extra_config=cfg,
    )


@dataclass
class Case:
    backend: object
    pool: object
    controller: HiCacheController

    def host_indices(self, pages: int = PAGES, first: int = FIRST) -> torch.Tensor:
        ps = self.pool.page_size
        return torch.arange(first * ps, (first + pages) * ps, dtype=torch.int64)

    def write(self, keys, first: int = FIRST) -> bool:
        idx = self.host_indices(len(keys), first)
        fn = self.controller.page_set_func
        return fn(list(keys), idx)

    def read(self, keys, first: int = FIRST) -> int:
        idx = self.host_indices(len(keys), first)
        op = PrefetchOperation("test-request", list(range(idx.numel())), None, None)
        return self.controller.page_get_func(op, list(keys), idx)

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        buf = self.pool.kv_buffer
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))

    def digests(self, pages: int = PAGES, first: int = FIRST) -> list[str]:
        """sha256 of each page's bytes (the pool's flat page, any layout)."""
        ps = self.pool.page_size
        return [
            hashlib.sha256(
                self.pool.get_data_page((first + p) * ps).contiguous().view(torch.uint8).numpy().tobytes()
            ).hexdigest()
            for p in range(pages)
        ]


def make_case(master: str | None, kind: str, layout: str, pool_kw: dict | None = None, **kw) -> Case:
    """Backend from the factory ("dynamic", the user's JSON) + a real host pool, attached as SGLang does.
    pool_kw: pool geometry (hicache_pools); kw: storage_config arguments."""
    make = hicache_pools.mla_pool if kind == "mla" else hicache_pools.mha_pool
    pool = make(layout, **(pool_kw or {}))
    sc = storage_config(master, kind=kind, **kw)
    backend = StorageBackendFactory.create_backend("dynamic", sc, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    ctl = object.__new__(HiCacheController)  # only the fields the page IO helpers read
    ctl.storage_backend, ctl.storage_host_pool, ctl.mem_pool_host = backend, pool, pool
    ctl.page_size, ctl.storage_config = pool.page_size, sc
    v1 = bool(sc.extra_config.get("interface_v1"))
    # the selection attach_storage_backend makes for a "dynamic" backend
    ctl.page_get_func = ctl._page_get_zero_copy if v1 else ctl._generic_page_get
    ctl.page_set_func = ctl._page_set_zero_copy if v1 else ctl._generic_page_set
    return Case(backend, pool, ctl)


def make_mooncake_case(master: str, kind: str, layout: str, tp_rank: int = 0, tp_size: int = 1) -> Case:
    """SGLang's own ``mooncake`` backend (``--hicache-storage-backend mooncake``, its MooncakeStore class) on a real
    host pool, with ``mooncake.store`` served by the kvplugins shim (the caller put it on sys.path) and its
    ``master_server_address`` pointing at our master; SGLang picks the zero-copy page IO for it."""
    make = hicache_pools.mla_pool if kind == "mla" else hicache_pools.mha_pool
    pool = make(layout)
    extra = {
        "master_server_address": master,
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "global_segment_size": 0,
        "device_name": "",
    }
    sc = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=kind == "mla",
        enable_storage_metrics=False,
        is_page_first_layout=layout.startswith("page_first"),
        model_name="test/model",
        extra_config=extra,
    )
    backend = StorageBackendFactory.create_backend("mooncake", sc, pool)
    backend.register_mem_pool_host(pool)
    ctl = object.__new__(HiCacheController)
    ctl.storage_backend, ctl.storage_host_pool, ctl.mem_pool_host = backend, pool, pool
    ctl.page_size, ctl.storage_config = pool.page_size, sc
    ctl.page_get_func, ctl.page_set_func = ctl._page_get_zero_copy, ctl._page_set_zero_copy  # attach's choice
    return Case(backend, pool, ctl)


def keys_for(tag: str, n: int = PAGES) -> list[str]:
    """SGLang-style page keys (sha256 hex), chained like a token prefix."""
    out, prev = [], tag.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + bytes([i])).hexdigest().encode()
        out.append(prev.decode())
    return out


def all_cases():
    """(kind, layout, v1) of every case the cross-process test covers."""
    return (
        [("mha", lay, True) for lay in MHA_LAYOUTS]
        + [("mla", lay, True) for lay in MLA_LAYOUTS]
        + [("mha", "layer_first", False), ("mha", "page_first", False), ("mla", "page_first", False)]
    )


def case_id(kind: str, layout: str, v1: bool) -> str:
    return f"{kind}-{layout}-{'v1' if v1 else 'legacy'}"
