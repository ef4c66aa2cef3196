"""Worker half: maps the engine's KV tensors once, then loads/saves whole pages straight into/from them.

Threads: small hits load inline before the forward; large hits load on the ``kvp-load`` thread (one
``batch_get_into`` per step, the transfer core moves the bytes) and are reported through ``finished``;
saves run on the ``kvp-save`` thread after the forward, never blocking it. A save reads blocks that stay
unchanged while their request holds them; ``fence`` waits, before a forward, for the saves of requests whose
blocks were freed (finished or preempted), so a reused block is never read half-rewritten. These threads,
and the transfer engines' server threads, run on every CPU vLLM gave the worker, not only on the one its
OpenMP binding pins the main thread to (threads.py).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import asdict, replace

from kvplugins.errors import ConfigError, ProtocolError
from kvplugins.layout import KeySpace, PageLayout, PageStore, Plane, block_dim_of, planes_of
from kvplugins.layout.shards import HeadShards
from kvplugins.layout.spans import head_planes
from kvplugins.vllm_kv_connector import engine, pd, threads
from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
from kvplugins.vllm_kv_connector.events import EventLog
from kvplugins.vllm_kv_connector.metadata import (
    Held,
    KVPluginsConnectorMetadata,
    PageBatch,
    RemoteLoad,
    WorkerHandshake,
)
from kvplugins.vllm_kv_connector.stats import StatsRecorder

log = logging.getLogger(__name__)
SLOW_S = 2.0  # a save, or a P/D hold mark, later than this is logged (why decode may have computed a prefix)
IDLE_WAIT_S = 0.01  # an idle step waits up to this long for a load, a held request's save or ack to end


class WorkerSide:
    def __init__(self, vllm_config, kv_cache_config, cfg: VllmConnectorConfig):
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self.cfg, self.kv_cache_config = cfg, kv_cache_config
        self.role = vllm_config.kv_transfer_config.kv_role
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.pp_rank = get_pp_group().rank_in_group if self.pp_size > 1 else 0
        self._pages_unit = int(self.tp_rank == 0 and self.pp_rank == 0)  # page counters: one worker counts a
        # page (every TP rank and PP stage moves its part of it); byte counters: every worker its own bytes
        self.groups = engine.groups(kv_cache_config, cfg.layer_chunks)  # KV cache groups, or their layer chunks
        self.whole_failure = engine.whole_request_failure(self.groups)  # a failed load fails its requests
        self.keyspace = engine.keyspace(vllm_config, kv_cache_config, cfg, self.tp_rank, self.groups[0])
        self._spaces = {g.uid: engine.keyspace(vllm_config, kv_cache_config, cfg, self.tp_rank, g) for g in self.groups}
        self._parts = {
            g.uid: engine.rank_spaces(vllm_config, kv_cache_config, cfg, self.tp_rank, g) for g in self.groups
        }  # Group.uid -> (key spaces of its parts, writes them)
        self._writes = {uid: w for uid, (_, w) in self._parts.items()}  # MLA: TP rank 0; a shared head: its first
        self.layouts: dict[int, PageLayout] = {}  # Group.uid -> this rank's whole pages (every head)
        self.pages: PageStore | None = None  # the first group's (P/D direct, logs); its client serves all
        self.group_pages: dict[int, PageStore | HeadShards] = {}  # Group.uid -> its pages (per head: shards.py)
        first = {}  # KV events: each KV cache group's first layer chunk
        self._event_groups = {g.uid: g for g in self.groups if first.setdefault(g.index, g.uid) == g.uid}
        self._chunk_of = {n: g.uid for g in self.groups for n in g.layer_names} if cfg.layer_chunks > 1 else {}
        self._layer_loads: dict[int, Future] = {}  # layer chunk (uid) -> this step's load of it
        self.failed_recving: set[str] = set()  # whole_failure: requests whose async load failed
        self.load_errors: set[int] = set()
        self.stats = StatsRecorder()
        self._load_pool = threads.pool("kvp-load")  # unpinned: see threads.py
        self._save_pool = threads.pool("kvp-save")
        self._layer_pool = threads.pool("kvp-layer")  # layer-wise synchronous loads (layer_chunks > 1)
        self._loading: dict[Future, dict[str, frozenset]] = {}  # async load batch -> request id -> its block ids
        self._saving: dict[str, Future] = {}  # request id -> its latest save batch
        self._held: dict[str, tuple[Held, float]] = {}  # P/D producer: request -> (hold, first seen, monotonic s)
        self._finished: set[str] = set()  # finished request ids vLLM told us about
        self._export = self._reader = None  # P/D direct: handover Producer / Consumer
        self._pd_handshake = None  # the Producer's Offer, as vLLM carries it
        self._early: KVPluginsConnectorMetadata | None = None  # the step whose async work fence started
        self._idle = self._waiting = False  # metadata.idle / .waiting of this step
        self._found_at = 0.0  # monotonic s this step's metadata arrived: its lookups had found their pages by then
        ev = getattr(vllm_config, "kv_events_config", None)
        self.events = EventLog(self.keyspace.block_size) if ev is not None and ev.enable_kv_cache_events else None

    def register(self, kv_caches: dict) -> None:
        """kv_caches: layer name -> KV tensor (CPU: [num_blocks, kv_heads, block_size, head_size*2]; GPU backends'
        NHD/HND/cross-layer/MLA layouts map the same way, see kvplugins.layout.spans). KV on a GPU (or any KV
        with staging='always') moves through pinned host bounce slots (kvplugins.layout.staged). Raises
        ConfigError if the pages it describes differ from the key space's page bytes, or the device cannot be
        staged."""
        num_blocks = self.kv_cache_config.num_blocks
        for g in self.groups:
            missing = [n for n in g.layer_names if n not in kv_caches]
            if missing:
                raise ConfigError(f"KVPluginsConnector: no KV tensor for layers {missing}")
            layout = PageLayout(
                [p for n in g.layer_names for p in _engine_blocks(_planes(kv_caches[n], num_blocks), num_blocks)]
            )
            if layout.page_bytes != self._spaces[g.uid].page_bytes:
                raise ConfigError(
                    f"KVPluginsConnector: KV tensors of group {g.index} give {layout.page_bytes} B "
                    f"pages, the KV cache spec {self._spaces[g.uid].page_bytes} B; unsupported KV "
                    "layout"
                )
            self.layouts[g.uid] = layout
            spaces = self._parts[g.uid][0]
            layouts = _head_layouts(g, spaces, kv_caches, num_blocks) if len(spaces) > 1 else [layout]
            parts = [self._page_store(ks, lay, len(self.groups) * len(spaces)) for ks, lay in zip(spaces, layouts)]
            self.group_pages[g.uid] = HeadShards(parts, layout) if len(parts) > 1 else parts[0]
        threads.run_unpinned(self.pages.connect)  # its transfer engine's server threads inherit the wide mask
        layout = self.layouts[self.groups[0].uid]
        if self.role == "kv_producer" and layout.device == "cpu" and len(self.groups) == 1 and self.pp_size == 1:
            self._export, self._pd_handshake = threads.run_unpinned(pd.producer, layout, self.cfg)
        elif self.role == "kv_producer" and self.cfg.pd_mode == "direct":
            log.warning(
                "kvplugins: pd_mode=direct reads KV blocks in host memory; this KV cache is on %s, so "
                "decode gets its KV through the store",
                layout.device,
            )
        log.info(
            "kvplugins: %d KV cache group(s) of %s layers, %d blocks, %d B pages on %s%s, namespace %s",
            len(self.groups),
            "/".join(str(len(g.layer_names)) for g in self.groups),
            layout.num_blocks,
            layout.page_bytes,
            layout.device,
            ", staged" if self.pages.staged else "",
            self.keyspace.namespace,
        )

    def _page_store(self, keyspace: KeySpace, layout: PageLayout, shares: int) -> PageStore:
        """A PageStore of ``layout``'s pages in ``keyspace``; the first made owns the client all share."""
        pages = PageStore(
            self.cfg.client_factory(),
            keyspace,
            layout,
            retry_ms=self.cfg.retry_ms,
            staged=_staged(layout, self.cfg, shares),
            share=self.pages,
        )
        self.pages = self.pages or pages
        return pages

    # -- loads ------------------------------------------------------------------------------------------------
    def load(self, meta: KVPluginsConnectorMetadata) -> None:
        """vLLM's start_load_kv: synchronous loads now; P/D holds marked and asynchronous loads submitted to
        the load thread unless ``fence`` did so. Staged loads copy into the blocks after what the engine
        already enqueued (the mark taken on the engine thread)."""
        after = self._mark()
        early, self._early = self._early, None
        self._idle, self._waiting = meta.idle, meta.waiting
        if meta is not early:
            self.hold(meta)
        if meta.loads.block_ids and self._chunk_of:
            self._load_layers(meta.loads, after)
        elif meta.loads.block_ids:
            self.load_errors.update(self._load_batch(meta.loads, after, self._found_at))
        if meta is not early:
            self._start_async(meta, after)

    def _start_async(self, meta: KVPluginsConnectorMetadata, after) -> None:
        """Submit the step's P/D acks and asynchronous loads (direct reads and store loads) to the load thread."""
        for remote in meta.acks:
            self._load_pool.submit(self._direct_ack, remote)
        direct = {r: b for r, b in meta.async_loads.items() if r in meta.remote}
        for req_id, pages in direct.items():
            fut = self._load_pool.submit(self._direct_batch, pages, meta.remote[req_id], self._found_at)
            self._loading[fut] = {req_id: frozenset(pages.block_ids)}
        batch, stored = PageBatch(), {}
        for req_id, pages in meta.async_loads.items():
            if req_id not in direct:
                batch.extend(pages)
                stored[req_id] = frozenset(pages.block_ids)
        self.stats.add(async_blocks=sum(len(b) for b in meta.async_loads.values()) * self._pages_unit)
        if stored:
            self._loading[self._load_pool.submit(self._load_batch, batch, after, self._found_at)] = stored

    def _load_layers(self, batch: PageBatch, after) -> None:
        """Layer-wise synchronous load: each layer chunk's pages on the ``kvp-layer`` thread, in layer order;
        the forward waits per chunk (``wait_layer``), and ``drain_layers`` before anything reads the results."""
        for uid, part in batch.by_group().items():
            self._layer_loads[uid] = self._layer_pool.submit(self._load_batch, part, after, self._found_at)

    def wait_layer(self, layer_name: str) -> None:
        """vLLM's wait_for_layer_load: return once the chunk holding ``layer_name`` has loaded (or failed: its
        blocks are then in ``load_errors`` and vLLM recomputes them). Other layers' loads keep running."""
        fut = self._layer_loads.pop(self._chunk_of.get(layer_name, -1), None)
        if fut is not None:
            self.load_errors.update(fut.result())
            self.stats.add(layer_waits=1)

    def drain_layers(self) -> None:
        """Wait for every layer chunk load of this step (a chunk whose layers the forward never waited for)."""
        for uid in list(self._layer_loads):
            self.load_errors.update(self._layer_loads.pop(uid).result())

    def _mark(self):
        """Staged KV: an event after the work the engine has enqueued so far (on the engine thread), else None."""
        staged = self.pages.staged if self.pages is not None else None
        return staged.mark() if staged is not None else None

    def _load_batch(self, batch: PageBatch, after=None, found_at: float | None = None) -> list[int]:
        """Load a batch; returns the block ids that did not land (every id when anything unexpected raised).
        ``found_at``: when its step's metadata arrived (PageStore.load: a store that failed before it is tried
        again at once, one that failed since, e.g. in this step's fence, is not waited for again)."""
        if not batch.block_ids:
            return []
        if self.pages is None:
            return list(batch.block_ids)
        t0 = time.perf_counter()
        failed, nbytes = [], 0
        for group, part in batch.by_group().items():
            try:
                bad = self.group_pages[group].load(part.block_ids, part.hashes, after, found_at)
            except Exception as e:  # noqa: BLE001 - a load must end in "loaded" or "failed", never in a lost thread
                log.warning("kvplugins: load of %d pages failed: %r", len(part), e)
                bad = list(part.block_ids)
            failed += bad
            nbytes += (len(part) - len(bad)) * self._spaces[group].page_bytes
        done = len(batch) - len(failed)
        self.stats.add(
            loaded_blocks=done * self._pages_unit, loaded_bytes=nbytes, failed_blocks=len(failed) * self._pages_unit
        )
        self.stats.observe("load_seconds", time.perf_counter() - t0)
        return failed

    def _reader_for(self):
        if self._reader is None:
            self._reader = pd.consumer(self.layouts[self.groups[0].uid], self.cfg)
        return self._reader

    def _direct_batch(self, batch: PageBatch, remote: RemoteLoad, found_at: float) -> list[int]:
        """P/D direct path: read the producer's blocks into ours, then ack; pages that did not arrive are tried
        in the store (a producer saves them as well); returns local ids that failed both."""
        t0 = time.perf_counter()
        src = remote.src.get(str(self.tp_rank)) if isinstance(remote.src, dict) else None
        direct = 0
        try:
            reader = self._reader_for()
            offer = pd.offer_of(src) if src else None
            failed = (
                reader.read(offer, batch.block_ids, remote.remote_ids, remote.slot, remote.token)
                if offer
                else list(batch.block_ids)
            )
            if offer:
                reader.ack(offer, remote.slot, remote.token)
            direct = len(batch) - len(failed)
            if failed and self.pages is not None:  # the producer saved its pages too: try the store for the rest
                failed = self._store_fallback(batch, failed, found_at)
        except Exception as e:  # noqa: BLE001 - a load must end in "loaded" or "failed", never in a lost thread
            log.warning("kvplugins: direct load of %d pages failed: %r", len(batch), e)
            failed = list(batch.block_ids)
        done = len(batch) - len(failed)
        self.stats.add(
            loaded_blocks=done * self._pages_unit,
            loaded_bytes=done * self.keyspace.page_bytes,
            failed_blocks=len(failed) * self._pages_unit,
            direct_blocks=direct * self._pages_unit,
        )
        self.stats.observe("load_seconds", time.perf_counter() - t0)
        return failed

    def _store_fallback(self, batch: PageBatch, block_ids: list[int], found_at: float) -> list[int]:
        """Load ``block_ids`` (of ``batch``) from the store (pages read past their lease are read again by the
        store client); returns the ids still missing."""
        if not block_ids:
            return block_ids
        idx = {b: i for i, b in enumerate(batch.block_ids)}
        hashes = [batch.hashes[idx[b]] for b in block_ids]
        return self.group_pages[self.groups[0].uid].load(block_ids, hashes, found_at=found_at)

    def _direct_ack(self, remote: RemoteLoad) -> None:
        """Ack the producer ranks this rank answers for: its own, and at another producer TP size every rank
        ``p`` with ``p % tp_size == tp_rank`` (so each producer rank is acked once)."""
        if not isinstance(remote.src, dict) or self.pages is None:
            return
        for rank, src in remote.src.items():
            if int(rank) % self.tp_size == self.tp_rank and src:
                try:
                    self._reader_for().ack(pd.offer_of(src), remote.slot, remote.token)
                except ProtocolError as e:
                    log.warning("kvplugins: not acking producer rank %s: %s", rank, e)

    def handshake(self) -> WorkerHandshake:
        """What the scheduler half needs from this worker: its Groups' key spaces and, on a P/D direct
        producer, what decode needs to read its KV (PDHandshake)."""
        return WorkerHandshake(
            spaces=[[asdict(k) for k in self._parts[g.uid][0]] for g in self.groups], pd=self._pd_handshake
        )

    # -- saves ------------------------------------------------------------------------------------------------
    def fence(self, meta: KVPluginsConnectorMetadata) -> None:
        """Before the forward (vLLM's handle_preemptions): wait for in-flight saves of requests whose blocks
        may be rewritten now. Then, where the scheduler allows it (``meta.early``), mark the step's P/D holds
        and start its acks and asynchronous loads at once. vLLM starts them only after the step's forward
        when it has no synchronous load, while a P/D producer holds its blocks, its engine stepping, until
        decode acks: on a 2-CPU host decode's forward, slowed by that stepping, delayed the ack ~30 s
        (issue #30)."""
        self._found_at = time.monotonic()  # before waiting for saves: a save failing now is a failure since
        for req_id in list(self._saving) if meta.fence_all else meta.fence:
            fut = self._saving.pop(req_id, None)
            if fut is not None:
                fut.result()
        if meta.early and (meta.acks or meta.async_loads or meta.held):
            self.hold(meta)
            self._start_async(meta, self._mark())
            self._early = meta

    def save(self, meta: KVPluginsConnectorMetadata) -> None:
        """After the forward: submit this step's full pages to the save thread (returns at once). A staged save
        gathers the blocks after the forward's work (the mark taken here)."""
        self.drain_layers()
        if not meta.saves or self.pages is None:
            return
        batch = PageBatch()
        for pages in meta.saves.values():
            batch.extend(pages)
        fut = self._save_pool.submit(self._save_batch, batch, self._mark())
        for req_id in meta.saves:
            self._saving[req_id] = fut

    def _save_batch(self, batch: PageBatch, after=None) -> None:
        t0, n, nbytes = time.perf_counter(), 0, 0
        for group, part in batch.by_group().items():
            if not self._writes[group]:  # a replicated group: TP rank 0 writes the one copy
                self.stats.add(replica_skips=len(part))
                self._record_stored(part, [True] * len(part), self._event_groups.get(group))
                continue
            try:
                written, held = self.group_pages[group].save_held(part.block_ids, part.hashes, after)
            except Exception as e:  # noqa: BLE001 - a failed save is a future miss, never an engine error
                log.warning("kvplugins: save of %d pages failed: %r", len(part), e)
                continue
            n, nbytes = n + written, nbytes + written * self._spaces[group].page_bytes
            self._record_stored(part, held, self._event_groups.get(group))  # a router's prefix events
        took = time.perf_counter() - t0
        self.stats.add(saved_blocks=n * self._pages_unit, saved_bytes=nbytes)
        self.stats.observe("save_seconds", took)
        if took > SLOW_S:
            log.warning("kvplugins: a save of %d pages took %.1f s (%d written)", len(batch), took, n)

    def _record_stored(self, batch: PageBatch, held_mask: list, group: engine.Group | None) -> None:
        """BlockStored events for the pages of ``batch`` (of ``group``) the store holds now (``held_mask``: per
        page; events.py), when events are on and ``group`` is its KV cache group's first chunk. A worker that
        does not write a replicated group reports its pages as held: an event completes only when every worker
        reported it, the writer included."""
        if self.events is None or not batch.token_ids or group is None:
            return
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        held = [i for i, ok in enumerate(held_mask) if ok]
        self.events.stored(
            [maybe_convert_block_hash(batch.hashes[i]) for i in held],
            [None if batch.parents[i] is None else maybe_convert_block_hash(batch.parents[i]) for i in held],
            [batch.token_ids[i] for i in held],
            group.spec,
            group.index,
        )

    # -- completion -------------------------------------------------------------------------------------------
    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving): requests whose async load ended (failed blocks, if any,
        are in ``load_errors`` by now, as vLLM requires)."""
        recving: set[str] = set()
        if self._idle:
            self._pace()
        for fut in [f for f in self._loading if f.done()]:
            reqs, failed = self._loading.pop(fut), set(fut.result())
            recving.update(reqs)
            if self.whole_failure:  # see engine.whole_request_failure: fail the requests, not their blocks
                self.failed_recving.update(r for r, ids in reqs.items() if ids & failed)
            else:
                self.load_errors.update(failed)
        sending = self._sent(finished_req_ids)
        for req_id in [r for r, f in self._saving.items() if f.done()]:
            del self._saving[req_id]
        return sending or None, recving or None

    def _pace(self) -> None:
        """An idle step (nothing scheduled: vLLM steps without pause while a request waits for its load, for a
        producer's pages to land in the store, or a producer holds blocks for decode): wait up to IDLE_WAIT_S
        until a load ends, a held request's save lands or decode acks a direct read. Without this, two engines
        sharing a few CPUs (P/D on one host) starve each other: the prefill side stepped at 100% CPU on two
        cores while it held blocks for decode, and decode's worker ran its next step ~30 s late; decode,
        looking the producer's pages up in the store every step, delayed the producer's save of them 26 s
        (issue #30)."""
        deadline = time.monotonic() + IDLE_WAIT_S
        while not self._reportable() and time.monotonic() < deadline:
            time.sleep(0.001)

    def _reportable(self) -> bool:
        if not self._loading and not self._held and not self._waiting:
            return True  # nothing to wait for: idle steps end when vLLM runs out of requests
        if any(f.done() for f in self._loading):
            return True
        for req_id, (held, _) in self._held.items():
            if held.mode == "store" and (req_id not in self._saving or self._saving[req_id].done()):
                return True
            if held.mode == "direct" and self._export is not None and self._export.acked(held.slot, held.token):
                return True
        return False

    def hold(self, meta: KVPluginsConnectorMetadata) -> None:
        """P/D producer: remember the requests whose blocks vLLM now holds for us."""
        now = time.monotonic()
        for req_id, held in meta.held.items():
            self._held[req_id] = (held, now)
            if held.mode == "direct" and self._export is not None:
                self._export.lease(held.slot, held.token)
            if held.finished_at and now - held.finished_at > SLOW_S:
                log.warning(
                    "kvplugins: request %s: its blocks were marked held %.1f s after it finished (engine "
                    "steps late); decode waits up to pd_wait_ms for that",
                    req_id,
                    now - held.finished_at,
                )

    def _sent(self, finished_req_ids: set[str]) -> set[str]:
        """Held requests that vLLM reported finished and whose blocks we no longer need."""
        self._finished.update(finished_req_ids)
        now, out = time.monotonic(), set()
        for req_id, (held, seen) in list(self._held.items()):
            if req_id not in self._finished:
                continue
            if held.mode == "store":
                fut = self._saving.get(req_id)
                done = fut is None or fut.done()
            else:
                done = (
                    self._export is not None and self._export.acked(held.slot, held.token)
                ) or now - seen > held.hold_s
            if done:
                self._handed_over(req_id, held, now)
                out.add(req_id)
                del self._held[req_id]
                self._finished.discard(req_id)
        self._finished.intersection_update(self._held)
        return out

    def _handed_over(self, req_id: str, held: Held, now: float) -> None:
        """Release a held request's blocks: its direct lease word back to 0 (decode reads from now on fail);
        the handoff latency (request end -> ack, or saves landed) goes to ``pd_handoff_seconds``."""
        took = now - held.finished_at if held.finished_at else 0.0
        self.stats.observe("pd_handoff_seconds", took)
        if held.mode == "direct" and self._export is not None:
            self._export.lease(held.slot, 0)
            if not self._export.acked(held.slot, held.token):
                log.warning(
                    "kvplugins: request %s: decode did not ack its read within pd_hold_ms=%.0f; "
                    "its blocks are released",
                    req_id,
                    held.hold_s * 1000,
                )
                return
        if took > SLOW_S:
            log.warning("kvplugins: request %s: handed over (%s) %.1f s after it finished", req_id, held.mode, took)

    def take_failed_recving(self) -> set[str]:
        failed, self.failed_recving = self.failed_recving, set()
        return failed

    def take_load_errors(self) -> set[int]:
        self.drain_layers()
        errors, self.load_errors = self.load_errors, set()
        return errors

    def close(self) -> None:
        """Let in-flight transfers end (each is bounded by the store timeouts), then close the client."""
        for pool in (self._layer_pool, self._load_pool, self._save_pool):
            pool.shutdown(wait=True)
        for side in (self._export, self._reader):
            if side is not None:
                side.close()
        for pages in self.group_pages.values():
            pages.close()


def _head_layouts(g: engine.Group, spaces: list[KeySpace], kv_caches: dict, num_blocks: int) -> list[PageLayout]:
    """One layout per KV head this rank holds (``spaces``, in head order) over group ``g``'s KV tensors. Raises
    ConfigError when a tensor does not keep a head's part of a block in one run (engine.per_head said it
    would: a layout vLLM named *HNC that is not)."""
    out = []
    for j, ks in enumerate(spaces):
        planes = []
        for n in g.layer_names:
            t = kv_caches[n]
            part = head_planes(t, block_dim_of(tuple(t.shape), num_blocks), len(spaces), j)
            if part is None:
                raise ConfigError(
                    f"KVPluginsConnector: KV tensor {n} of shape {tuple(t.shape)} does not hold "
                    f"{len(spaces)} KV heads as runs of bytes per block, as its layout "
                    f"({ks.extra.rsplit('layout=', 1)[-1]}) says; report this layout"
                )
            planes += _engine_blocks(part, num_blocks)
        out.append(PageLayout(planes))
    return out


def _staged(layout: PageLayout, cfg: VllmConnectorConfig, shares: int = 1):
    """The bounce path for ``layout`` (layout/staged.py) when its KV is on a device, or staging='always'; else
    None: ``bounce_bytes / shares`` of host memory (one share per Group). Raises ConfigError for device KV with
    staging='never', or a device that cannot be staged."""
    if cfg.staging == "never" and layout.device != "cpu":
        raise ConfigError(
            f"KVPluginsConnector: the KV cache is on {layout.device} and staging='never'; set "
            "staging='auto' to move its pages through pinned host memory"
        )
    if cfg.staging == "always" or layout.device != "cpu":
        from kvplugins.layout.staged import StagedPages

        return StagedPages(layout, cfg.bounce_bytes // shares, slot_timeout_s=2 * cfg.store.transfer_timeout_ms / 1000)
    return None


def _planes(tensor, num_blocks: int) -> list[Plane]:
    """A layer's planes: CPU ``[num_blocks, ...]``, FlashAttention ``[2, num_blocks, ...]`` (K/V planes), HND or
    cross-layer views (see kvplugins.layout.spans); a Mamba layer's list of state tensors (conv, ssm...), each
    ``[num_blocks, ...]`` over vLLM's padded pages, gives one plane per tensor."""
    if isinstance(tensor, (list, tuple)):
        return [p for t in tensor for p in _planes(t, num_blocks)]
    return planes_of(tensor, block_dim_of(tuple(tensor.shape), num_blocks))


def _engine_blocks(planes: list[Plane], num_blocks: int) -> list[Plane]:
    """Planes in units of engine blocks: a kernel may split one engine block into k adjacent kernel blocks."""
    out = []
    for p in planes:
        k, rem = divmod(p.num_blocks, num_blocks)
        if rem or k < 1 or (k > 1 and p.block_stride != p.block_bytes):
            raise ConfigError(f"KV tensor with {p.num_blocks} blocks does not map onto {num_blocks} engine blocks")
        out.append(
            replace(p, block_stride=p.block_stride * k, block_bytes=p.block_bytes * k, num_blocks=num_blocks)
            if k > 1
            else p
        )
    return out
