"""Replaying requests through per-instance caches and the shared pool (the real store).

Per request, as an engine with a KV connector serves it (prefix semantics, SGLang HiCache / vLLM connector):
  1. the router picks an instance;
  2. its local cache (if any) answers the longest prefix it holds;
  3. the pool (if any) is asked for the longest stored prefix of the remaining blocks (``batch_exists_prefix``)
     and those blocks are read (``batch_get``);
  4. the rest is "prefilled" and put into the pool (``batch_put``); the local cache admits all the blocks.
Hits count blocks of that stored prefix only: a block stored after a missing one is recomputed, as engines do.

Two modes: as fast as possible (one thread, the hit ratio and the store's throughput), and realtime (arrivals at
the trace's timestamps / speed, one worker thread and client per instance, each op's latency recorded).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from kvplugins.errors import StoreError, TransferError
from kvplugins.replay.caches import LocalLRU, Router
from kvplugins.replay.timing import Timing


@dataclass(frozen=True)
class Plan:
    """One configuration: ``label``; the pool's capacity in blocks (0 = no pool); each instance's local capacity
    in blocks (0 = none); ``instances``; ``routing``; tokens per block; realtime ``speed`` (0 = as fast as
    possible); ``miss_on_store_error``: a store error serves the request as a miss and is counted (what the
    connectors do), instead of ending the replay. The TTFT model (timing.py; as fast as possible only), on when
    ``prefill_tok_s`` > 0: prefill tokens/s and pool load bytes/s of an instance, full-scale ``block_bytes``,
    the TTFT SLO (ms; 0 = none), and ``clock``: the trace's arrivals run this many times faster."""

    label: str
    pool_blocks: int
    local_blocks: int
    instances: int
    routing: str = "round_robin"
    block_tokens: int = 512
    speed: float = 0.0
    miss_on_store_error: bool = False
    prefill_tok_s: float = 0.0
    load_bytes_s: float = 0.0
    block_bytes: int = 0
    slo_ms: float = 0.0
    clock: float = 1.0


@dataclass
class Result:
    """Counts of one replay. Blocks and tokens are the trace's (full scale); ``seconds`` is wall time."""

    plan: Plan
    requests: int = 0
    blocks: int = 0
    local_hits: int = 0
    pool_hits: int = 0
    tokens: int = 0
    tokens_saved: int = 0
    puts: int = 0
    put_failures: int = 0
    gets: int = 0
    get_misses: int = 0
    wrong_bytes: int = 0
    store_errors: int = 0  # requests served as a miss because the store raised (miss_on_store_error)
    seconds: float = 0.0
    max_lag_ms: float = 0.0
    latency: dict = field(default_factory=lambda: {"exists": [], "get": [], "put": []})
    ttft_ms: list = field(default_factory=list)  # the TTFT model's, per served request
    rejected: int = 0  # requests the Conductor rejected early
    slo_met: int = 0  # served requests within the TTFT SLO
    span_s: float = 0.0  # simulated seconds from the first arrival to the last

    @property
    def hit_ratio(self) -> float:
        return (self.local_hits + self.pool_hits) / self.blocks if self.blocks else 0.0


class _Instance:
    def __init__(self, plan: Plan, pool):
        self.local = LocalLRU(plan.local_blocks) if plan.local_blocks else None
        self.pool, self.miss_on_error = pool, plan.miss_on_store_error

    def serve(self, req, res: Result, block_tokens: int, lock) -> tuple[int, int]:
        """Serves ``req``; (blocks from the local cache, blocks from the pool)."""
        blocks = req.blocks
        h1 = self.local.prefix(blocks) if self.local else 0
        h2 = 0
        if self.pool is not None and h1 < len(blocks):
            h2 = self._pool(blocks[h1:], res, lock)
        if self.local:
            self.local.admit(blocks)
        with lock:
            res.requests += 1
            res.blocks += len(blocks)
            res.local_hits += h1
            res.pool_hits += h2
            res.tokens += req.input_length
            res.tokens_saved += min((h1 + h2) * block_tokens, req.input_length)
        return h1, h2

    def _pool(self, blocks, res: Result, lock) -> int:
        """Steps 3-4 for ``blocks``; returns the pool hits. A StoreError or TransferError propagates, or with
        miss_on_error is counted and the request is a miss (its blocks recomputed, not stored)."""
        keys = self.pool.keys(blocks)
        try:
            hit = self.pool.prefix(keys)
            self.pool.fetch(keys[:hit])
            self.pool.store(keys[hit:])
        except (StoreError, TransferError):
            if not self.miss_on_error:
                raise
            with lock:
                res.store_errors += 1
            return 0
        return hit


def replay(requests, plan: Plan, make_pool, progress=None) -> Result:
    """Replay ``requests`` under ``plan``. ``make_pool(namespace)`` -> a PoolOps (its own StoreClient), or None
    with no pool; ``progress(n)`` is called after each request. Returns the Result; store errors other than a
    failed put propagate (a store that stops answering ends the replay with its error) unless
    ``plan.miss_on_store_error``."""
    ns = f"replay-{uuid.uuid4().hex[:8]}"
    res, lock = Result(plan), threading.Lock()
    pools = [make_pool(ns) if plan.pool_blocks else None for _ in range(plan.instances if plan.speed else 1)]
    insts = [_Instance(plan, pools[i % len(pools)]) for i in range(plan.instances)]
    router = Router(plan.routing, plan.instances)
    t0 = time.perf_counter()
    try:
        if plan.speed:
            _realtime(requests, plan, insts, router, res, lock, progress)
        else:
            timing = Timing(plan, insts) if plan.prefill_tok_s else None
            for req in requests:
                if timing is not None and timing.conductor is not None:
                    i = timing.choose(req, res)
                else:
                    i = router.pick(req, [i.local for i in insts] if plan.local_blocks else None)
                if i is not None:
                    local, pooled = insts[i].serve(req, res, plan.block_tokens, lock)
                    if timing is not None:
                        timing.served(i, req, local, pooled, res)
                if progress:
                    progress(1)
    finally:
        res.seconds = time.perf_counter() - t0
        for p in pools:
            if p is not None:
                _collect(res, p)
                p.client.close()
    return res


def _collect(res: Result, p) -> None:
    res.puts += p.puts
    res.put_failures += p.put_failures
    res.gets += p.gets
    res.get_misses += p.get_misses
    res.wrong_bytes += p.wrong_bytes
    for op, v in p.latency.items():
        res.latency[op].extend(v)


def _realtime(requests, plan: Plan, insts, router, res: Result, lock, progress) -> None:
    """Arrivals at (timestamp - first) / speed; one worker per instance; the dispatcher's lateness is recorded."""
    queues = [queue.Queue() for _ in insts]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        while (req := queues[i].get()) is not None:
            try:
                insts[i].serve(req, res, plan.block_tokens, lock)
            except BaseException as e:  # noqa: BLE001 - handed to the dispatcher, re-raised there
                errors.append(e)
            if progress:
                progress(1)

    workers = [threading.Thread(target=work, args=(i,), name=f"kvp-replay-{i}", daemon=True) for i in range(len(insts))]
    for w in workers:
        w.start()
    start, first = time.perf_counter(), requests[0].timestamp_ms if requests else 0.0
    try:
        for req in requests:
            due = start + (req.timestamp_ms - first) / 1000 / plan.speed
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            else:
                res.max_lag_ms = max(res.max_lag_ms, -wait * 1000)
            if errors:
                break
            queues[router.pick(req, [i.local for i in insts] if plan.local_blocks else None)].put(req)
    finally:
        for q in queues:
            q.put(None)
        for w in workers:
            w.join()
    if errors:
        raise errors[0]
