"""Scheduler half: which prefix pages the store holds, which blocks to load into and which to save.

Per request it remembers the planned load (from the last lookup) and how many of its pages were already
handed to the worker for saving. Pages are named by vLLM's chained block hashes (``request.block_hashes``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvplugins.layout import PageStore, loadable_pages, page_hashes
from kvplugins.vllm_kv_connector import engine
from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
from kvplugins.vllm_kv_connector.metadata import KVPluginsConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class _Tracked:
    request: "Request"
    first: int = 0      # first page of the planned load (block-aligned local hit / block_size)
    hit: int = 0        # pages the store holds from ``first`` on
    saved: int = 0      # pages [0, saved) already handed to the worker for saving


class SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, cfg: VllmConnectorConfig):
        self.cfg = cfg
        ks = engine.keyspace(vllm_config, kv_cache_config, cfg)
        self.block_size = ks.block_size
        self.hash_block_size = engine.hash_block_size(kv_cache_config, ks.block_size)
        self.pages = PageStore(cfg.client_factory(), ks, ranks=range(ks.tp_size), retry_ms=cfg.retry_ms)
        self.pages.connect()
        if cfg.namespace_file:
            _write_namespaces(cfg.namespace_file, ks)
        self.tracked: dict[str, _Tracked] = {}
        self.pending = KVPluginsConnectorMetadata()

    def _hashes(self, request: "Request") -> list[bytes]:
        return page_hashes(request.block_hashes, self.hash_block_size, self.block_size)

    def num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        first = num_computed_tokens // self.block_size
        t = self.tracked.setdefault(request.request_id, _Tracked(request))
        t.first, t.hit = first, 0
        if not self.cfg.load:
            return 0, False
        candidates = self._hashes(request)[first:loadable_pages(request.num_tokens, self.block_size)]
        t.hit = self.pages.stored_prefix(candidates)
        return t.hit * self.block_size, False

    def after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        t = self.tracked.setdefault(request.request_id, _Tracked(request))
        if num_external_tokens <= 0:
            return
        n = min(num_external_tokens // self.block_size, t.hit)
        hashes = self._hashes(request)[t.first:t.first + n]
        self.pending.loads.add(block_ids[t.first:t.first + n], hashes)

    def build_meta(self, out: "SchedulerOutput") -> KVPluginsConnectorMetadata:
        meta, self.pending = self.pending, KVPluginsConnectorMetadata()
        if self.cfg.save:
            for req_id, computed in _computed_after_step(out).items():
                self._plan_save(meta, req_id, computed, out)
        return meta

    def _plan_save(self, meta, req_id: str, computed: int, out: "SchedulerOutput") -> None:
        t = self.tracked.get(req_id)
        if t is None:
            return
        hashes = self._hashes(t.request)
        full = min(computed // self.block_size, len(hashes))
        if full <= t.saved:
            return
        block_ids = _block_ids(out, req_id)
        if block_ids is None or len(block_ids) < full:
            return
        meta.saves.add(block_ids[t.saved:full], hashes[t.saved:full])
        t.saved = full

    def finished(self, request: "Request") -> None:
        self.tracked.pop(request.request_id, None)


def _write_namespaces(path: str, ks) -> None:
    """JSON {"namespaces": {tp_rank: namespace}, "keyspace": fields}: a key is ``namespace/<block hash hex>``."""
    info = {"namespaces": {r: ks.for_rank(r).namespace for r in range(ks.tp_size)}, "keyspace": asdict(ks)}
    Path(path).write_text(json.dumps(info, indent=1))


def _computed_after_step(out: "SchedulerOutput") -> dict[str, int]:
    """req_id -> tokens whose KV is in the cache once this step ran."""
    before = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens))
    return {rid: before[rid] + n for rid, n in out.num_scheduled_tokens.items() if rid in before}


def _block_ids(out: "SchedulerOutput", req_id: str) -> list[int] | None:
    state = out.kv_connector_block_state
    ids = state.get_block_ids(req_id) if state is not None else None
    return None if ids is None else ids[0]
