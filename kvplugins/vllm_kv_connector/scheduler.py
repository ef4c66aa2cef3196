"""Scheduler half: which prefix pages the store holds, which blocks to load into and which to save.

Per request it remembers the planned load (from the last lookup) and how many of its pages were already
handed to the worker for saving. Pages are named by vLLM's chained block hashes (``request.block_hashes``).
"""
from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvplugins.layout import PageStore, loadable_pages, page_hashes
from kvplugins.vllm_kv_connector import engine
from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
from kvplugins.vllm_kv_connector.metadata import Held, KVPluginsConnectorMetadata, PageBatch, RemoteLoad
from kvplugins.vllm_kv_connector.pd import MAILBOX_SLOTS, PARAMS_KEY, handshake_dict, params_of
from kvplugins.vllm_kv_connector.stats import StatsRecorder

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class _Tracked:
    request: "Request"
    first: int = 0      # first page of the planned load (block-aligned local hit / block_size)
    hit: int = 0        # pages the store holds from ``first`` on
    looked: int = 0     # pages looked up from ``first`` on
    load_async: bool = False
    saved: int = 0      # pages [0, saved) already handed to the worker for saving
    remote: dict | None = None          # P/D direct: the producer's params this request loads from
    loading: frozenset = frozenset()    # block ids of its last planned load
    failed: bool = False                # a load of it failed: compute it from now on (no retry loop)
    wait_until: float | None = None     # P/D store: stop waiting for the producer's pages then


log = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, cfg: VllmConnectorConfig):
        self.cfg = cfg
        self.role = vllm_config.kv_transfer_config.kv_role
        ks = engine.keyspace(vllm_config, kv_cache_config, cfg)
        self.namespace = ks.namespace
        self.handshakes: dict = {}           # P/D direct (producer): TP rank -> PDHandshake of its worker
        self._token = secrets.randbits(62)   # P/D direct: ack tokens, unique per producer lifetime
        self.block_size = ks.block_size
        self.hash_block_size = engine.hash_block_size(kv_cache_config, ks.block_size)
        self.pages = PageStore(cfg.client_factory(), ks, ranks=range(ks.tp_size), retry_ms=cfg.retry_ms)
        self.pages.connect()
        if cfg.namespace_file:
            _write_namespaces(cfg.namespace_file, ks)
        self.tracked: dict[str, _Tracked] = {}
        self.pending = KVPluginsConnectorMetadata()
        self.stats = StatsRecorder()
        ev = getattr(vllm_config, "kv_events_config", None)
        self.events_on = bool(ev is not None and ev.enable_kv_cache_events)   # saves carry tokens for events
        self._events = None     # workers' BlockStored events not yet complete (events.KVPluginsKVEvents)

    def _hashes(self, request: "Request") -> list[bytes]:
        return page_hashes(request.block_hashes, self.hash_block_size, self.block_size)

    def num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        first = num_computed_tokens // self.block_size
        t = self.tracked.setdefault(request.request_id, _Tracked(request))
        t.first, t.hit, t.looked, t.load_async = first, 0, 0, False
        if not self.cfg.load or t.failed:
            return 0, False
        loadable = loadable_pages(request.num_tokens, self.block_size)
        pd = params_of(request) if self.role != "kv_producer" else None
        if pd is not None and pd.get("namespace") != self.namespace:
            log.warning("kvplugins: P/D params of request %s name key namespace %s, this engine %s (different "
                        "model, dtype, block size or TP): computing its prefix", request.request_id,
                        pd.get("namespace"), self.namespace)
            pd = None
        want = max(0, min(int(pd["pages"]), loadable) - first) if pd else 0
        if pd and pd.get("mode") == "direct":
            return self._direct_match(t, pd, want)
        candidates = self._hashes(request)[first:loadable]
        t.hit, t.looked = self.pages.stored_prefix(candidates), len(candidates)
        if t.hit < want:  # P/D store path: the producer's saves may still be landing
            now = time.monotonic()
            t.wait_until = t.wait_until or now + self.cfg.pd_wait_ms / 1000
            if now < t.wait_until:
                return None, False
            log.warning("kvplugins: request %s: %d of the producer's %d pages in the store after %d ms; "
                        "computing the rest", request.request_id, t.hit, want, self.cfg.pd_wait_ms)
        tokens = t.hit * self.block_size
        t.load_async = 0 < self.cfg.async_load_tokens <= tokens
        return tokens, t.load_async

    def _direct_match(self, t: _Tracked, pd: dict, want: int) -> tuple[int, bool]:
        """P/D direct path: the producer's blocks are there to read; load them in the background."""
        t.remote, t.hit, t.looked, t.load_async = pd, want, want, want > 0
        if not want:
            self.pending.acks.append(RemoteLoad(pd["ranks"], [], pd["slot"], pd["token"]))
        return want * self.block_size, want > 0

    def after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the load of the pages vLLM allocated blocks for; an async load is always planned (even empty)
        because vLLM waits for its completion."""
        t = self.tracked.setdefault(request.request_id, _Tracked(request))
        n = min(max(num_external_tokens, 0) // self.block_size, t.hit)
        if t.looked:
            self.stats.add(hit_blocks=n, miss_blocks=t.looked - n)
            t.looked = 0
        remote = None
        if t.remote is not None:
            pd, t.remote = t.remote, None
            remote = RemoteLoad(pd["ranks"], list(pd["block_ids"][t.first:t.first + n]), pd["slot"], pd["token"])
            if num_external_tokens <= 0:
                self.pending.acks.append(remote)
        if num_external_tokens <= 0:
            return
        batch = PageBatch(block_ids[t.first:t.first + n], self._hashes(request)[t.first:t.first + n])
        t.loading = frozenset(batch.block_ids)
        if remote is not None:
            self.pending.remote[request.request_id] = remote
        if t.load_async:
            self.pending.async_loads[request.request_id] = batch
        else:
            self.pending.loads.add(batch.block_ids, batch.hashes)

    def load_failed(self, block_ids: set[int]) -> None:
        """Blocks that failed to load (vLLM's invalid_block_ids): their requests compute from now on, so a
        failing page is not looked up, loaded and recomputed again and again."""
        for t in self.tracked.values():
            if t.loading & block_ids:
                t.failed, t.loading = True, frozenset()

    def add_events(self, events) -> None:
        """The workers' events of one step (vLLM merged every TP worker's)."""
        if self._events is None:
            self._events = events
        else:
            self._events.add_events(events.get_all_events())

    def take_events(self) -> list:
        """Events every worker reported (the rest wait for the missing workers)."""
        return self._events.take_complete() if self._events is not None else []

    def build_meta(self, out: "SchedulerOutput") -> KVPluginsConnectorMetadata:
        meta, self.pending = self.pending, KVPluginsConnectorMetadata()
        meta.fence = (set(out.finished_req_ids) | set(out.preempted_req_ids or ())) - set(meta.held)
        if self.cfg.save and self.role != "kv_consumer":
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
        tokens, parents = (), ()
        if self.events_on:
            ids, b = t.request.all_token_ids, self.block_size
            tokens = [list(ids[i * b:(i + 1) * b]) for i in range(t.saved, full)]
            parents = [hashes[i - 1] if i else None for i in range(t.saved, full)]
        meta.saves.setdefault(req_id, PageBatch()).add(block_ids[t.saved:full], hashes[t.saved:full], tokens, parents)
        t.saved = full

    def finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        """vLLM's request_finished. A producer hands the request's full prompt pages to decode: returns
        (True, {"kvplugins": params}) and vLLM holds the blocks until the worker reports the request sent."""
        self.tracked.pop(request.request_id, None)
        if self.role != "kv_producer":
            return False, None
        pages = min(request.num_computed_tokens, request.num_prompt_tokens, len(block_ids) * self.block_size)
        pages //= self.block_size
        if pages <= 0:
            return False, None
        asked = (getattr(request, "kv_transfer_params", None) or {}).get("kvplugins_mode")
        mode = asked if asked in ("store", "direct") else self.cfg.pd_mode  # per request, else pd_mode
        params = {"v": 1, "mode": mode, "pages": pages, "namespace": self.namespace}
        held = Held("store")
        if mode == "direct" and self.handshakes:
            self._token += 1
            slot = self._token % MAILBOX_SLOTS
            params.update(block_ids=list(block_ids[:pages]), slot=slot, token=self._token,
                          ranks={str(r): handshake_dict(h) for r, h in self.handshakes.items()})
            held = Held("direct", slot, self._token, self.cfg.pd_hold_ms / 1000)
        elif mode == "direct":
            log.warning("kvplugins: pd_mode=direct but no worker exported its KV; handing over through the store")
            params["mode"] = "store"
        self.pending.held[request.request_id] = held
        return True, {PARAMS_KEY: params}


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
