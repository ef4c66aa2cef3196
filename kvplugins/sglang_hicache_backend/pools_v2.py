"""Storage interface v2: SGLang's side pools (swa, mamba, indexer, draft...) beside the KV pool.

SGLang's HybridCacheController registers every host pool of a hybrid model by name
(``register_mem_host_pool_v2``) and moves a node's side-pool pages with ``PoolTransfer`` lists. Every pool is
keyed under the KV page hashes, so each pool gets its own key space (the pool name is in it): no two pools can
collide. A pool's page is one store object, the concatenation of its ``get_page_buffer_meta`` pieces, zero-copy
like the KV pages.

Hit rule (``batch_exists_v2``, as SGLang 0.5.23 ``hicache_storage.py`` HiCacheFile and the mooncake_store backend
define it): KV gives the longest stored prefix; an ``ALL_PAGES`` pool allows every prefix length up to its first
missing page; a ``TRAILING_PAGES`` pool with N keys allows a length p only if pages [max(0, p - N), p) are stored
(N = 1 for Mamba state, the window for SWA). The KV hit is the longest length every pool allows; the lengths all
pools allow are returned too (``restorable_prefix_pages``), since a trailing pool's set has holes.
"""

from __future__ import annotations

from typing import Sequence

ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"


def allowed_lengths(policy: str, trailing: int, stored: Sequence[bool]) -> set[int]:
    """Prefix lengths (pages, >= 1) a pool allows, from whether each page of the KV prefix is stored for it.
    Raises ValueError for a policy other than all_pages / trailing_pages (BLOCK_GROUPS is not supported)."""
    if policy == ALL_PAGES:
        n = next((i for i, ok in enumerate(stored) if not ok), len(stored))
        return set(range(1, n + 1))
    if policy == TRAILING_PAGES:
        need = max(1, trailing)
        return {p for p in range(1, len(stored) + 1) if all(stored[max(0, p - need) : p])}
    raise ValueError(f"hit policy {policy!r}: kvplugins serves all_pages and trailing_pages pools")


def combine(kv_pages: int, pools: dict[str, set[int]]) -> tuple[int, dict[str, int], list[int]]:
    """(KV hit pages, each pool's own longest allowed length, every length all pools allow, ascending)."""
    restorable = set(range(1, kv_pages + 1))
    for lengths in pools.values():
        restorable &= lengths
    per_pool = {name: max(lengths, default=0) for name, lengths in pools.items()}
    return max(restorable, default=0), per_pool, sorted(restorable)
