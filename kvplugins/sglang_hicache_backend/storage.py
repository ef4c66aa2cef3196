"""``KVPluginsHiCacheStorage``: SGLang's HiCache L3 storage on the kvplugins store (a thin adapter).

SGLang builds it through ``StorageBackendFactory`` ("dynamic" backend) as ``cls(storage_config, kwargs)``; the
host pool arrives later (``register_mem_pool_host``), and ``on_host_pools_registered`` connects and registers
the pool's host KV memory with the transfer engine, so pages move host memory <-> store with no copy.

One store object per page: the concatenation of the page's buffer-metadata pieces (``get_page_buffer_meta``,
any layout: page_first, page_first_direct, page_head, layer_first). Keys: ``layout.keys.KeySpace`` over model,
KV dtype, page size, pool kind, layout, I/O format, PP rank and, for MHA, TP rank/size (MLA ranks share pages;
only ``is_storage_writer`` ranks write). Page I/O, outage handling (reads miss, writes report False, reconnect
after ``retry_ms``) and per-page results live in ``kvplugins.layout.hicache.KeyedPageStore``.

Interface v2 (hybrid models): every other host pool SGLang registers by name (swa, mamba, indexer, ...) gets a
key space of its own and shares the KV pool's store client; ``batch_exists_v2`` applies SGLang's ALL_PAGES /
TRAILING_PAGES hit policies (pools_v2.py).

Source followed: SGLang 0.5.23 ``mem_cache/hicache_storage.py`` (HiCacheStorage v1 and v2 interfaces, PoolTransfer,
PoolTransferResult), ``managers/cache_controller.py`` and ``mem_cache/hybrid_cache/hybrid_cache_controller.py``
(how the prefetch/backup threads call it).
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Protocol

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from kvplugins.layout.hicache import KeyedPageStore, hicache_keyspace, key_bytes
from kvplugins.layout.keys import KeySpace
from kvplugins.sglang_hicache_backend import legacy, pools_v2
from kvplugins.sglang_hicache_backend.config import from_extra_config
from kvplugins.sglang_hicache_backend.metrics import Metrics
from kvplugins.sglang_hicache_backend.pool import meta_layout, page_bytes, page_starts, page_tokens, pool_kind

log = logging.getLogger(__name__)
NOT_ATTACHED = (
    "KVPluginsHiCacheStorage: no host pool registered yet (SGLang calls register_mem_pool_host before any page I/O)"
)


class HostPool(Protocol):
    """What this module reads of an SGLang host pool (HostKVCache, or a v2 side pool) itself; pool.py the rest."""

    layout: str

    def get_size_per_token(self) -> int: ...


class KVPluginsHiCacheStorage(HiCacheStorage):
    """HiCache L3 backend. storage_config: SGLang's HiCacheStorageConfig (its ``extra_config`` holds our keys,
    see kvplugins/sglang_hicache_backend/config.py). kwargs: extra factory arguments (unused).
    Raises ConfigError for an unknown extra-config key or a bad value. Never needs the store to be up."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict[str, object]] = None) -> None:
        self.storage_config = storage_config
        extra = storage_config.extra_config or {}
        self.config = from_extra_config(extra)
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self.is_writer = storage_config.is_storage_writer
        self.mem_pool_host: HostPool | None = None
        self._pages: KeyedPageStore | None = None  # v1 namespace, zero-copy
        self._flat: KeySpace | None = None  # legacy namespace (flat page tensors)
        self._side: dict[str, tuple[HostPool, KeyedPageStore]] = {}  # v2: pool name -> (host pool, its pages)
        self._metrics = Metrics(storage_config.enable_storage_metrics)

    # ---- host pools ------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: HostPool) -> None:
        super().register_mem_pool_host(mem_pool_host)
        v1, flat = (self._keyspace(mem_pool_host, fmt) for fmt in ("v1", "flat"))
        self.close()  # a re-attach replaces the previous pool's connection
        self._pages = KeyedPageStore(self._client, v1, meta_layout(mem_pool_host), retry_ms=self.config.retry_ms)
        self._flat, self._side = flat, {}

    def register_mem_host_pool_v2(self, host_pool: HostPool, host_pool_name: object) -> None:
        """A hybrid model's host pool by name (SGLang PoolName: kv, swa, mamba, indexer, draft...). The KV anchor
        keeps its v1 pages; any other pool gets its own key space (the name in it) on the KV pool's client.
        Raises ConfigError for a pool without host memory, RuntimeError before register_mem_pool_host."""
        name = _name(host_pool_name)
        if host_pool is self.mem_pool_host:
            return
        space = self._keyspace(host_pool, "v1", name)
        self._side[name] = (
            host_pool,
            KeyedPageStore(
                self._client, space, meta_layout(host_pool), retry_ms=self.config.retry_ms, share=self._store()
            ),
        )

    def on_host_pools_registered(self) -> None:
        """Connect now and register the host KV memory (a store that is down is retried on use)."""
        if self._pages is not None and not self._pages.connect():
            log.warning("kvplugins: store not reachable at attach; HiCache L3 serves misses until it is")

    def _client(self) -> object:
        from kvplugins.store import StoreClient

        return StoreClient(self.config.store)

    def _keyspace(self, pool: HostPool, io_format: str, name: str = "") -> KeySpace:
        sc, kind = self.storage_config, pool_kind(pool)
        extra = f"ns={self.config.namespace};cp{sc.attn_cp_rank}/{sc.attn_cp_size};dcp{sc.dcp_rank}/{sc.dcp_size}"
        size = page_bytes(pool) if io_format == "v1" else pool.get_size_per_token() * page_tokens(pool)
        return hicache_keyspace(
            model=sc.model_name or "",
            kv_dtype=str(getattr(pool, "dtype", "state")),
            page_size=page_tokens(pool),
            page_bytes=size,
            pool=f"{kind}:{name}" if name else kind,
            layout=pool.layout,
            tp_rank=sc.tp_rank,
            tp_size=sc.tp_size,
            pp_rank=sc.pp_rank,
            pp_size=sc.pp_size,
            shared_across_tp=kind == "mla",
            io_format=io_format,
            extra=extra,
        )

    def _store(self) -> KeyedPageStore:
        if self._pages is None:
            raise RuntimeError(NOT_ATTACHED)
        return self._pages

    def _flat_space(self) -> KeySpace:
        """The legacy key space (set with the v1 pages by register_mem_pool_host)."""
        if self._flat is None:
            raise RuntimeError(NOT_ATTACHED)
        return self._flat

    # ---- zero-copy (v1) ----------------------------------------------------------------------------------
    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Scatter each stored page straight into the host pool. True per page whose bytes landed; a miss or an
        unreachable store is False. Raises ValueError on inconsistent arguments (never returns None)."""
        store = self._store()
        starts = page_starts(self.mem_pool_host, host_indices, len(keys))
        t0 = time.perf_counter()
        ok = store.load_each(starts, keys) if keys else []
        self._metrics.prefetch(sum(ok), store.keyspace.page_bytes, time.perf_counter() - t0)
        return ok

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Gather each page straight from the host pool into the store, skipping stored pages (one exists RPC).
        Non-writer MLA ranks write nothing (True: the writer rank stores the shared page). Never raises: any
        failure is logged and reported as False for the pages concerned."""
        if not self.is_writer:
            return [True] * len(keys)
        try:
            store = self._store()
            starts = page_starts(self.mem_pool_host, host_indices, len(keys))
            t0 = time.perf_counter()
            ok = store.save_each(starts, keys)
        except Exception as e:  # noqa: BLE001 - never raise into SGLang's backup thread
            log.error("kvplugins: batch_set_v1 of %d pages failed: %r", len(keys), e)
            return [False] * len(keys)
        self._metrics.backup(sum(ok), store.keyspace.page_bytes, time.perf_counter() - t0)
        return ok

    # ---- interface v2 (hybrid models: side pools) -----------------------------------------------------------
    def batch_exists_v2(
        self,
        keys: List[str],
        pool_transfers: Optional[List[PoolTransfer]] = None,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> PoolTransferResult:
        """The longest KV prefix of ``keys`` (page hashes) every transfer's pool can restore under its hit policy,
        each pool's own boundary (and "kv"), and every restorable length. One exists RPC per pool; a store that
        is down is a miss (0). Raises ValueError for a BLOCK_GROUPS pool (not supported)."""
        store = self._store()
        kv = store.stored_prefix_in(store.keyspace, keys)
        lengths = {}
        for t in pool_transfers or []:
            name = _name(t.name)
            side = self._side.get(name)
            stored = side[1].stored_mask(key_bytes(keys[:kv])) if side is not None else []
            lengths[name] = pools_v2.allowed_lengths(_name(t.hit_policy), len(t.keys or ()), stored)
        hit, per_pool, restorable = pools_v2.combine(kv, lengths)
        return PoolTransferResult(hit, {"kv": kv, **per_pool}, restorable)

    def batch_get_v2(
        self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> dict[str, List[bool]]:
        """Scatter each transfer's pages (``keys[i]`` -> the page at ``host_indices``) into its pool; True per page
        that landed. A pool never registered, or inconsistent indices, read as all False (logged)."""
        return {_name(t.name): self._side_io(t, "load") for t in transfers}

    def batch_set_v2(
        self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> dict[str, List[bool]]:
        """Store each transfer's pages from its pool (stored ones skipped); True per page stored. Never raises:
        SGLang skips the KV backup after a raising batch_set_v2. Non-writer ranks skip pools shared across TP
        (MLA), and write per-rank ones (Mamba state is TP-sharded)."""
        return {_name(t.name): self._side_io(t, "save") for t in transfers}

    def _side_io(self, t: PoolTransfer, op: str) -> List[bool]:
        keys = list(t.keys or ())
        side = self._side.get(_name(t.name))
        if side is None:
            log.warning(
                "kvplugins: %s of %d pages of pool %s, which was never registered: refused",
                op,
                len(keys),
                _name(t.name),
            )
            return [False] * len(keys)
        pool, pages = side
        if op == "save" and not self.is_writer and pool_kind(pool) == "mla":
            return [True] * len(keys)
        try:
            starts = page_starts(pool, t.host_indices, len(keys))
            return (pages.load_each if op == "load" else pages.save_each)(starts, keys) if keys else []
        except Exception as e:  # noqa: BLE001 - a side pool's I/O ends in per-page results, never in SGLang's thread
            log.warning("kvplugins: %s of %d pages of pool %s failed: %r", op, len(keys), _name(t.name), e)
            return [False] * len(keys)

    # ---- legacy (flat page tensors; SGLang's generic page IO when interface_v1 is off) -------------------
    def get(
        self,
        key: str,
        target_location: object = None,
        target_sizes: object = None,
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self,
        keys: List[str],
        target_locations: object = None,
        target_sizes: object = None,
    ) -> List[torch.Tensor | None]:
        """Each stored page copied into ``target_locations[i]`` (a flat tensor of the page's bytes), or None."""
        return legacy.batch_get(self._store(), self._flat_space(), keys, target_locations)

    def set(
        self,
        key: str,
        value: object = None,
        target_location: object = None,
        target_sizes: object = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: List[str],
        values: object = None,
        target_locations: object = None,
        target_sizes: object = None,
    ) -> bool:
        """Store flat page tensors; True if every page is stored. Never raises a store error."""
        if not self.is_writer:
            return True
        return legacy.batch_set(self._store(), self._flat_space(), keys, values)

    # ---- lookups -------------------------------------------------------------------------------------------
    def _lookup_space(self) -> KeySpace:
        return self._store().keyspace if self.interface_v1 else self._flat_space()

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Number of consecutive stored pages from the start of ``keys``, in one RPC; 0 if the store is down."""
        return self._store().stored_prefix_in(self._lookup_space(), keys)

    # ---- housekeeping --------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Remove the pages this backend instance stored (other engines' pages in the shared pool stay)."""
        if self._pages is not None:
            self._pages.remove_saved()

    def get_stats(self) -> object:
        """SGLang StorageMetrics (pages and GB/s per prefetch/backup batch since the last call) plus the store
        client's counters: hits, misses, bytes_put, bytes_got, put/get batch latency p50/p99 (µs)."""
        client = self._pages.client_if_connected() if self._pages is not None else None
        return self._metrics.snapshot(
            client.stats() if client is not None else {}, self._pages.stats if self._pages is not None else {}
        )

    def close(self) -> None:
        """Disconnect from the store (idempotent)."""
        for _, pages in self._side.values():
            pages.close()
        if self._pages is not None:
            self._pages.close()


def _name(value: object) -> str:
    """An SGLang str enum (PoolName, PoolHitPolicy) or plain string, as its string value."""
    return str(getattr(value, "value", value))
