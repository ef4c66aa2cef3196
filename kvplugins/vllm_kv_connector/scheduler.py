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

from kvplugins.layout import KeySpace, PageStore, loadable_pages, page_hashes
from kvplugins.vllm_kv_connector import engine
from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
from kvplugins.vllm_kv_connector.metadata import (
    Held,
    KVPluginsConnectorMetadata,
    PageBatch,
    RemoteLoad,
    WorkerHandshake,
)
from kvplugins.vllm_kv_connector.pd import MAILBOX_SLOTS, PARAMS_KEY, handshake_dict, params_of
from kvplugins.vllm_kv_connector.stats import StatsRecorder

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class _Tracked:
    request: "Request"
    first: int = 0  # first page of the planned load (block-aligned local hit / block_size)
    hit: int = 0  # pages the store holds from ``first`` on
    looked: int = 0  # pages looked up from ``first`` on
    load_async: bool = False
    saved: int = 0  # pages [0, saved) already handed to the worker for saving
    remote: dict | None = None  # P/D direct: the producer's params this request loads from
    loading: frozenset = frozenset()  # block ids of its last planned load
    failed: bool = False  # a load of it failed: compute it from now on (no retry loop)
    wait_until: float | None = None  # P/D store: stop waiting for the producer's pages then
    acked: bool = False  # P/D direct at another TP size: the producer was told to free its blocks


log = logging.getLogger(__name__)
NULL_BLOCK = 0  # vLLM's null block id (v1/core/block_pool.py): a table slot with no KV (outside a window)


class SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, cfg: VllmConnectorConfig):
        self.cfg = cfg
        self.role = vllm_config.kv_transfer_config.kv_role
        self.groups = engine.groups(kv_cache_config, cfg.layer_chunks)  # KV cache groups, or their layer chunks
        spaces = [engine.keyspace(vllm_config, kv_cache_config, cfg, group=g) for g in self.groups]
        ks = spaces[0]
        self.handshakes: dict = {}  # P/D direct (producer): TP rank -> PDHandshake of its worker (set_workers)
        self._token = secrets.randbits(62)  # P/D direct: ack tokens, unique per producer lifetime
        self.block_size = ks.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.hash_block_size = engine.hash_block_size(kv_cache_config, ks.block_size)
        required = [engine.required_spaces(vllm_config, kv_cache_config, cfg, g) for g in self.groups]
        self.pages = PageStore(cfg.client_factory(), ks, required=required[0], retry_ms=cfg.retry_ms)
        self.group_pages = (
            [self.pages]
            + [  # one per Group (uid order), one client; [0] also answers P/D, events
                PageStore(cfg.client_factory(), k, required=r, retry_ms=cfg.retry_ms, share=self.pages)
                for k, r in zip(spaces[1:], required[1:])
            ]
        )  # a hit needs every TP rank's parts (PP stages': set_workers)
        self.namespace = required[0][0].namespace  # P/D: engines needing the same objects share pages
        self.pages.connect()
        self.whole_failure = engine.whole_request_failure(self.groups)  # a failed load fails its requests
        # one full-attention group: one page object per page and a hit needs every page (the direct P/D path
        # reads exactly that); layer chunks, several groups or a window / state group go through the store
        self.plain = (
            len(self.groups) == 1
            and not self.groups[0].window_blocks
            and vllm_config.parallel_config.pipeline_parallel_size == 1
        )
        self._fence_all = any(g.window_blocks for g in self.groups)  # blocks leave a window mid-request
        self._state_uids: dict[int, list[int]] = {}  # KV cache group index -> its state Groups (layer chunks)
        for g in self.groups:
            if g.state:
                self._state_uids.setdefault(g.index, []).append(g.uid)
        self._spaces = spaces
        self.prefix_cache: KVCacheManager | None = None  # bind_kv_cache_manager: failed blocks leave its cache
        if cfg.namespace_file:
            _write_namespaces(cfg.namespace_file, spaces, self.hash_block_size, required)
        self.tracked: dict[str, _Tracked] = {}
        self._waiting: set[str] = set()  # P/D store path: requests waiting for the producer's saves
        self.pending = KVPluginsConnectorMetadata()
        self.stats = StatsRecorder()
        ev = getattr(vllm_config, "kv_events_config", None)
        self.events_on = bool(ev is not None and ev.enable_kv_cache_events)  # saves carry tokens for events
        self._events = None  # workers' BlockStored events not yet complete (events.KVPluginsKVEvents)

    def set_workers(self, workers: dict) -> None:
        """The workers' handshakes ((PP rank, TP rank) -> metadata.WorkerHandshake): from now on a hit needs the
        pages of every distinct key space any worker holds, per Group (each PP stage's layers, each TP rank's
        heads; a replicated group's one copy), and P/D direct reads use the producer's exports."""
        workers = {k: h for k, h in workers.items() if isinstance(h, WorkerHandshake)}  # MultiConnector may hand
        if not workers:  # us another connector's: keep the computed spaces
            return
        self.handshakes = {tp: h.pd for (pp, tp), h in sorted(workers.items()) if pp == 0 and h.pd is not None}
        required = []
        for uid, pages in enumerate(self.group_pages):
            spaces = {KeySpace(**d) for h in workers.values() for d in h.spaces[uid]}
            required.append(sorted(spaces, key=lambda k: (k.layer_group, k.tp_rank)))
            pages.require(required[-1])
        self.namespace = required[0][0].namespace
        if self.cfg.namespace_file:
            _write_namespaces(self.cfg.namespace_file, self._spaces, self.hash_block_size, required)

    def _hashes(self, request: "Request") -> list[bytes]:
        return page_hashes(request.block_hashes, self.hash_block_size, self.block_size)

    def num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        first = num_computed_tokens // self.block_size
        t = self.tracked.setdefault(request.request_id, _Tracked(request))
        self._waiting.discard(request.request_id)
        t.first, t.hit, t.looked, t.load_async = first, 0, 0, False
        if not self.cfg.load or t.failed:
            return 0, False
        loadable = loadable_pages(request.num_tokens, self.block_size)
        pd = params_of(request) if self.role != "kv_producer" else None
        if pd is not None and pd.get("namespace") != self.namespace:
            log.warning(
                "kvplugins: P/D params of request %s name key namespace %s, this engine %s (different "
                "model, dtype, block size or TP): computing its prefix",
                request.request_id,
                pd.get("namespace"),
                self.namespace,
            )
            pd = None
        want = max(0, min(int(pd["pages"]), loadable) - first) if pd else 0
        if pd and pd.get("mode") == "direct" and self.plain and len(pd["ranks"]) == self.tp_size:
            return self._direct_match(t, pd, want)
        if pd and pd.get("mode") == "direct" and not t.acked:  # direct reads need the producer's TP size: read
            t.acked = True  # what it saved, and let it free its blocks
            self.pending.acks.append(RemoteLoad(pd["ranks"], [], pd["slot"], pd["token"]))
        candidates = self._hashes(request)[first:loadable]
        t.hit, t.looked = self._stored(candidates, first), len(candidates)
        if t.hit < want:  # P/D store path: the producer's saves may still be landing
            now = time.monotonic()
            t.wait_until = t.wait_until or now + self.cfg.pd_wait_ms / 1000
            if now < t.wait_until:
                self._waiting.add(request.request_id)
                return None, False
            log.warning(
                "kvplugins: request %s: %d of the producer's %d pages in the store after %d ms; computing the rest",
                request.request_id,
                t.hit,
                want,
                self.cfg.pd_wait_ms,
            )
        tokens = t.hit * self.block_size
        # loads that must fail whole requests (engine.whole_request_failure) are asynchronous: vLLM takes a
        # failed load back per request (failed_recving) only there
        t.load_async = tokens > 0 and (self.whole_failure or 0 < self.cfg.async_load_tokens <= tokens)
        return tokens, t.load_async

    def _stored(self, hashes: list[bytes], first: int) -> int:
        """Pages from ``first`` on that a hit may take: the longest run [first, first + n) for which every
        group holds the pages it needs (full attention: all of them; sliding window: those of the window before
        first + n, as vLLM's own prefix cache requires). One exists RPC per group."""
        if self.plain:
            return self.pages.stored_prefix(hashes)
        n, windows = len(hashes), []
        for g, pages in zip(self.groups, self.group_pages):
            if not g.window_blocks:
                n = min(n, pages.stored_prefix(hashes[:n]))
        for g, pages in zip(self.groups, self.group_pages):
            if g.window_blocks and n:
                windows.append((g, pages.stored_mask(hashes[:n])))
        while n and not all(all(mask[p - first] for p in g.needed(first, first + n)) for g, mask in windows):
            n -= 1
        return n

    def _direct_match(self, t: _Tracked, pd: dict, want: int) -> tuple[int, bool]:
        """P/D direct path: the producer's blocks are there to read; load them in the background."""
        t.remote, t.hit, t.looked, t.load_async = pd, want, want, want > 0
        if not want:
            self.pending.acks.append(RemoteLoad(pd["ranks"], [], pd["slot"], pd["token"]))
        return want * self.block_size, want > 0

    def after_alloc(
        self, request: "Request", group_block_ids: tuple[list[int], ...] | list[list[int]], num_external_tokens: int
    ) -> None:
        """Plan the load of the pages vLLM allocated blocks for (``group_block_ids``: the request's block table per
        KV cache group); an async load is always planned (even empty) because vLLM waits for its completion."""
        t = self.tracked.setdefault(request.request_id, _Tracked(request))
        n = min(max(num_external_tokens, 0) // self.block_size, t.hit)
        if t.looked:
            self.stats.add(hit_blocks=n, miss_blocks=t.looked - n)
            t.looked = 0
        remote = None
        if t.remote is not None:
            pd, t.remote = t.remote, None
            remote = RemoteLoad(pd["ranks"], list(pd["block_ids"][t.first : t.first + n]), pd["slot"], pd["token"])
            if num_external_tokens <= 0:
                self.pending.acks.append(remote)
        if num_external_tokens <= 0:
            return
        batch = self._load_batch(group_block_ids, self._hashes(request), t.first, t.first + n)
        t.loading = frozenset(batch.block_ids)
        if remote is not None:
            self.pending.remote[request.request_id] = remote
        if t.load_async:
            self.pending.async_loads[request.request_id] = batch
        else:
            self.pending.loads.extend(batch)

    def _load_batch(self, group_block_ids, hashes: list[bytes], first: int, end: int) -> PageBatch:
        """Pages [first, end) each group needs, into the blocks vLLM allocated for them (a block id 0 is
        vLLM's null block: a page outside a sliding window, never loaded)."""
        batch = PageBatch()
        for g in self.groups:
            ids = group_block_ids[g.index]
            pages = [p for p in g.needed(first, end) if p < len(ids) and ids[p] != NULL_BLOCK]
            batch.add([ids[p] for p in pages], [hashes[p] for p in pages], group=g.uid)
        return batch

    def loads_failed(self, req_ids: set[str]) -> None:
        """Requests whose async load failed (vLLM's failed_recving; engine.whole_request_failure): they compute
        from now on."""
        for req_id in req_ids:
            t = self.tracked.get(req_id)
            if t is not None:
                t.failed, t.loading = True, frozenset()

    def load_failed(self, block_ids: set[int]) -> None:
        """Blocks that failed to load (vLLM's invalid_block_ids): their requests compute from now on, so a
        failing page is not looked up, loaded and recomputed again and again. The blocks also leave vLLM's
        prefix cache: a synchronous load's blocks were cached under their hashes when allocated (vLLM 0.32
        ``KVCacheManager.allocate_slots``), and with policy "recompute" vLLM keeps them there until its request
        recomputes them; a request preempted before that, or a new request sharing the prefix, would otherwise
        take the zeroed blocks as a local hit. Evicting a block still in use only drops its cache entry."""
        for t in self.tracked.values():
            if t.loading & block_ids:
                t.failed, t.loading = True, frozenset()
        if self.prefix_cache is not None:
            self.prefix_cache.evict_blocks(block_ids)

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
        meta.fence_all = self._fence_all
        meta.early = _untouched(out, meta)
        meta.idle = not out.total_num_scheduled_tokens
        meta.waiting = bool(self._waiting)
        if self.cfg.save and self.role != "kv_consumer":
            for req_id, computed in _computed_after_step(out).items():
                self._plan_save(meta, req_id, computed, out)
            self._plan_state_saves(meta, out)
        return meta

    def _plan_state_saves(self, meta, out: "SchedulerOutput") -> None:
        """Mamba / linear-attention groups: save the exact blocks vLLM hands over this step
        (``kv_connector_block_state.boundary_state_offloads``: request -> [(KV cache group, block id, boundary
        tokens)], states this step's forward writes), each as the page that ends at its boundary. A boundary
        inside a page (a prompt's tail) has no page key and is skipped. Such blocks can be freed right after the
        step; ``fence_all`` (on with a state group) keeps them until their save has read them."""
        state = getattr(out, "kv_connector_block_state", None)
        offloads = state.boundary_state_offloads if state is not None else None
        if not offloads or not self._state_uids:
            return
        b = self.block_size
        for req_id, entries in offloads.items():
            t = self.tracked.get(req_id)
            if t is None:
                continue
            hashes = self._hashes(t.request)
            for index, block_id, tokens in entries:
                page, rem = divmod(tokens, b)
                if rem or not 0 < page <= len(hashes) or block_id == NULL_BLOCK or index not in self._state_uids:
                    continue
                ev = (
                    ([list(t.request.all_token_ids[tokens - b : tokens])], [hashes[page - 2] if page > 1 else None])
                    if self.events_on
                    else ((), ())
                )  # token ids / parents for KV events, aligned with the pages
                for uid in self._state_uids[index]:
                    meta.saves.setdefault(req_id, PageBatch()).add([block_id], [hashes[page - 1]], *ev, group=uid)

    def _plan_save(self, meta, req_id: str, computed: int, out: "SchedulerOutput") -> None:
        t = self.tracked.get(req_id)
        if t is None:
            return
        hashes = self._hashes(t.request)
        full = min(computed // self.block_size, len(hashes))
        if full <= t.saved:
            return
        group_ids = _block_ids(out, req_id)
        if group_ids is None or len(group_ids[0]) < full:
            return
        tokens = parents = None
        if self.events_on:
            ids, b = t.request.all_token_ids, self.block_size
            tokens = {i: list(ids[i * b : (i + 1) * b]) for i in range(t.saved, full)}
            parents = {i: hashes[i - 1] if i else None for i in range(t.saved, full)}
        batch = meta.saves.setdefault(req_id, PageBatch())
        for g in (g for g in self.groups if not g.state):  # state groups: _plan_state_saves
            ids = group_ids[g.index]  # a sliding-window group's pages that already left the window are null blocks
            pages = [p for p in range(t.saved, min(full, len(ids))) if ids[p] != NULL_BLOCK]
            batch.add(
                [ids[p] for p in pages],
                [hashes[p] for p in pages],
                [tokens[p] for p in pages] if tokens else (),
                [parents[p] for p in pages] if parents else (),
                group=g.uid,
            )
        t.saved = full

    def finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        """vLLM's request_finished. A producer hands the request's full prompt pages to decode: returns
        (True, {"kvplugins": params}) and vLLM holds the blocks until the worker reports the request sent."""
        self.tracked.pop(request.request_id, None)
        self._waiting.discard(request.request_id)
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
        if mode == "direct" and not self.plain:
            params["mode"] = "store"  # the direct path reads one full-attention object per page
        elif mode == "direct" and self.handshakes:
            self._token += 1
            slot = self._token % MAILBOX_SLOTS
            params.update(
                block_ids=list(block_ids[:pages]),
                slot=slot,
                token=self._token,
                ranks={str(r): handshake_dict(h) for r, h in self.handshakes.items()},
            )
            held = Held("direct", slot, self._token, self.cfg.pd_hold_ms / 1000)
        elif mode == "direct":
            log.warning("kvplugins: pd_mode=direct but no worker exported its KV; handing over through the store")
            params["mode"] = "store"
        held.finished_at = time.monotonic()
        self.pending.held[request.request_id] = held
        return True, {PARAMS_KEY: params}


def _write_namespaces(path: str, spaces: list, hash_block_size: int, required: list) -> None:
    """JSON {"namespaces": {tp_rank: namespace}, "keyspace": fields, "groups": [fields per Group], "required":
    [[fields, ...] per Group: the key spaces a hit needs, every TP rank's (or KV head's) and PP stage's, each
    with its objects' page_bytes], "hash_block_size": tokens} of the scheduler's (PP stage 0's) first group (and every group): a key is ``namespace/<hex>`` where
    hex is vLLM's chained block hash (hashed every ``hash_block_size`` tokens) at the end of the page. Written
    at start, again once the workers told their key spaces; replaced atomically."""
    ks = spaces[0]
    info = {
        "namespaces": {r: ks.for_rank(r).namespace for r in range(ks.tp_size)},
        "keyspace": asdict(ks),
        "groups": [asdict(k) for k in spaces],
        "required": [[asdict(k) for k in r] for r in required],
        "hash_block_size": hash_block_size,
    }
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(info, indent=1))
    tmp.replace(path)


def _untouched(out: "SchedulerOutput", meta: KVPluginsConnectorMetadata) -> bool:
    """Whether this step's asynchronous loads may start before its forward: vLLM zeroes freshly allocated
    blocks (``new_block_ids_to_zero``) and applies copy-on-write copies (``kv_cache_block_copies``) on the
    worker before the forward, so a load into such a block must start after them."""
    if getattr(out, "kv_cache_block_copies", None):
        return False
    zeroed = set(getattr(out, "new_block_ids_to_zero", None) or ())
    return not any(zeroed.intersection(b.block_ids) for b in meta.async_loads.values())


def _computed_after_step(out: "SchedulerOutput") -> dict[str, int]:
    """req_id -> tokens whose KV is in the cache once this step ran."""
    before = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens))
    return {rid: before[rid] + n for rid, n in out.num_scheduled_tokens.items() if rid in before}


def _block_ids(out: "SchedulerOutput", req_id: str) -> tuple[list[int], ...] | None:
    """The request's current block table per KV cache group (vLLM's kv_connector_block_state), or None."""
    state = out.kv_connector_block_state
    return state.get_block_ids(req_id) if state is not None else None
