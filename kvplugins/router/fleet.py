"""What ``kvplugins router`` knows of its instances and how it picks one (kvplugins/router/cost.py's Conductor).

Per instance: healthy or not (its /health, and whether a request to it failed), requests in flight and the prefill
tokens they still owe (the queue: those tokens / prefill_tok_s), and the blocks its cache holds: an LRU of block
ids that the router's own routing history fills (a prompt routed there left its blocks in that engine's prefix
cache, like SGLang's router's approximate tree) and, where the instance's KV event stream is read (feeds.py), the
engine's own events correct (BlockStored adds what it cached, also for requests that did not pass the router;
BlockRemoved takes out what it evicted). Fleet-wide: the blocks the shared pool holds (blocks.py), which any
instance can load at ``load_gbps`` instead of computing. A prompt's blocks are its tokens in blocks of
``block_tokens``, each block's id chained on the previous one (blocks.chain), full blocks only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvplugins.replay.caches import LocalLRU
from kvplugins.router.blocks import BlockNames, Pool, canonical, chain, key_hash
from kvplugins.router.config import RouterConfig
from kvplugins.router.rates import Correction
from kvplugins.router.cost import Candidate, Conductor, CostModel, Decision
from kvplugins.store.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# A BlockStored in these media: the page is in the shared pool, not the instance's own memory. vLLM: CPU is what our
# connector announces (vLLM's own CPU offloading is not shared, but it announces through the same medium: see
# docs/operations.md); SGLang: EXTERNAL (its L3 shared pool; its CPU_PINNED and DISK tiers are the instance's own).
POOL_MEDIA = ("CPU", "STORAGE", "EXTERNAL")


def block_ids(tokens: list[int], block_tokens: int) -> list[int]:
    """Chained ids of the full blocks of ``tokens`` (block i's id covers tokens [0, (i+1) * block_tokens))."""
    out, prev = [], 0
    for i in range(len(tokens) // block_tokens):
        prev = chain(prev, tokens[i * block_tokens : (i + 1) * block_tokens])
        out.append(prev)
    return out


@dataclass
class Instance:
    url: str
    cache: LocalLRU
    healthy: bool = True
    inflight: int = 0
    owed_tokens: int = 0  # prefill tokens of its requests in flight not yet past their first token
    routed: int = 0
    down_since: float = 0.0
    why: str = ""
    events: int = 0  # KV events applied from its stream
    correction: Correction = field(default_factory=Correction)  # its measured / predicted TTFT


@dataclass
class Ticket:
    """One routed request: its instance, the prefill tokens it owes until its first token, the prediction."""

    instance: Instance
    owed: int
    predicted_s: float
    local_blocks: int = 0
    pool_blocks: int = 0
    scale: float = 1.0  # the correction in effect when it was predicted
    started: float = field(default_factory=time.monotonic)
    first_seen: bool = False


class Fleet:
    """The instances of ``cfg`` and the Conductor over them. Thread-safe."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.instances = [Instance(u, LocalLRU(cfg.cache_blocks)) for u in cfg.urls()]
        self.decoders = [Instance(u, LocalLRU(0)) for u in cfg.decode_urls()]  # P/D: the decode instances
        model = CostModel(cfg.prefill_tok_s, cfg.load_gbps * 1e9, cfg.block_tokens, cfg.block_bytes)
        self.conductor = Conductor(model, cfg.slo_ttft_ms / 1000)
        self.names = BlockNames(cfg.cache_blocks * len(self.instances))
        self.pool = Pool(cfg.cache_blocks * len(self.instances))
        self._turn = 0  # --routing round_robin / prefix_aware ties: whose turn it is
        self.skipped = 0  # events of another block size than block_tokens (not understood)
        self._lock = threading.Lock()

    def choose(
        self, prompt_tokens: int, blocks: list[int], exclude: set[str], engine_hashes: list[int] | None = None
    ) -> tuple[Decision, Ticket | None]:
        """The Conductor's decision over the healthy instances not in ``exclude`` and, unless it rejected, the
        request's ticket (the instance's queue and cache updated). ``engine_hashes``: the blocks' hashes as the
        engines compute them (blocks.EngineHasher), if known. Decision.index -1 and no ticket: rejected, or
        (predicted_s = inf) no instance to try."""
        with self._lock:
            if engine_hashes:
                self.names.teach(blocks, engine_hashes)
            live = [(i, inst) for i, inst in enumerate(self.instances) if inst.healthy and inst.url not in exclude]
            live.sort(key=lambda p: (p[1].inflight, p[1].routed))  # equal predictions: the least used first
            if not live:
                return Decision(-1, float("inf")), None
            if self.cfg.max_imbalance:  # no instance more than max_imbalance requests above the least loaded
                least = live[0][1].inflight
                live = [(i, inst) for i, inst in live if inst.inflight <= least + self.cfg.max_imbalance]
            cands = []
            for i, inst in live:
                local = inst.cache.prefix(blocks)
                pool = self.pool.prefix(self.names, blocks, local)
                scale = inst.correction.scale if self.cfg.measure_rates else 1.0
                cands.append(Candidate(i, inst.owed_tokens / self.cfg.prefill_tok_s, local, pool, scale))
            d = self._decide(prompt_tokens, cands)
            if d.rejected:
                return d, None
            c = next(c for c in cands if c.index == d.index)
            inst = self.instances[d.index]
            cached = min(prompt_tokens, (c.local_blocks + c.pool_blocks) * self.cfg.block_tokens)
            inst.cache.admit(blocks)
            inst.inflight += 1
            inst.routed += 1
            inst.owed_tokens += prompt_tokens - cached
            return d, Ticket(inst, prompt_tokens - cached, d.predicted_s, c.local_blocks, c.pool_blocks, c.scale)

    def _decide(self, prompt_tokens: int, cands: list[Candidate]) -> Decision:
        """The Conductor's decision, or a baseline's (--routing) with the Conductor's prediction for its pick."""
        if self.cfg.routing == "conductor":
            return self.conductor.choose(prompt_tokens, cands)
        self._turn += 1
        by_url = sorted(cands, key=lambda c: c.index)  # a fixed order to take turns over
        pick = by_url[self._turn % len(by_url)]
        if self.cfg.routing == "prefix_aware":
            best = max(c.local_blocks for c in cands)
            if best:
                pick = next(c for c in by_url[self._turn % len(by_url) :] + by_url if c.local_blocks == best)
        return Decision(pick.index, self.conductor.predict(prompt_tokens, pick))

    # -- KV events (feeds.py) -----------------------------------------------------------------------
    def engine_events(self, index: int, events: list[KVEvent]) -> None:
        """Apply a batch of instance ``index``'s KV event stream: its cache's blocks, and the pages its connector
        saved to the pool (BlockStored with medium CPU/STORAGE)."""
        with self._lock:
            inst = self.instances[index]
            inst.events += len(events)
            for e in events:
                if isinstance(e, BlockStored):
                    if e.block_size != self.cfg.block_tokens:
                        self.skipped += 1
                        continue
                    rids = self.names.learn(e.parent_block_hash, e.block_hashes, e.token_ids, e.block_size)
                    if e.medium in POOL_MEDIA:
                        for h in e.block_hashes:
                            self.pool.seen(canonical(h))
                    else:
                        inst.cache.admit(rids)
                elif isinstance(e, BlockRemoved):
                    if e.medium not in POOL_MEDIA:
                        inst.cache.discard([r for r in map(self.names.rid, e.block_hashes) if r is not None])
                elif isinstance(e, AllBlocksCleared):
                    inst.cache.clear()

    def set_load_rate(self, load_bytes_s: float | None) -> None:
        """The pool's load rate the instances measured (rates.Rates); None keeps the current one."""
        if load_bytes_s:
            with self._lock:
                m = self.conductor.model
                self.conductor.model = CostModel(m.prefill_tok_s, load_bytes_s, m.block_tokens, m.block_bytes)

    def observe(self, t: Ticket, measured_s: float) -> None:
        """``t``'s first token came ``measured_s`` after it was routed: it teaches its instance's correction
        (rates.Correction), which scales that instance's predictions with measure_rates."""
        with self._lock:
            t.instance.correction.observe(t.predicted_s / t.scale, measured_s)

    def rates(self) -> dict[str, object]:
        with self._lock:
            return {
                "prefill_tok_s": self.conductor.model.prefill_tok_s,
                "load_bytes_s": self.conductor.model.load_bytes_s,
                "measured_over_predicted": {i.url: round(i.correction.scale, 3) for i in self.instances},
                "corrected": self.cfg.measure_rates,
            }

    def engine_restarted(self, index: int) -> None:
        """Instance ``index``'s stream began again (its sequence went back): its cache starts empty."""
        with self._lock:
            self.instances[index].cache.clear()

    def pool_events(self, events: list[KVEvent], fresh: bool = False) -> None:
        """Apply a batch of the master's stream (object keys ``<namespace>/<hash hex>``); ``fresh``: the stream
        began again (a new master), so what the pool held is forgotten first."""
        with self._lock:
            if fresh:
                self.pool = Pool(self.pool.capacity)
            self.pool.exact = True
            for e in events:
                if isinstance(e, (BlockStored, BlockRemoved)):
                    for k in e.block_hashes:
                        h = key_hash(k) if isinstance(k, bytes) else None
                        if h is not None:
                            (self.pool.add if isinstance(e, BlockStored) else self.pool.remove)(h)

    def decoder(self, exclude: set[str]) -> Instance | None:
        """P/D: the healthy decode instance not in ``exclude`` with the fewest requests in flight (ties: the less
        used), now counted in flight (``release`` when its answer ended); None if there is none."""
        with self._lock:
            live = [d for d in self.decoders if d.healthy and d.url not in exclude]
            if not live:
                return None
            d = min(live, key=lambda d: (d.inflight, d.routed))
            d.inflight += 1
            d.routed += 1
            return d

    def release(self, d: Instance) -> None:
        with self._lock:
            d.inflight -= 1

    def first_token(self, t: Ticket) -> None:
        """The request's first bytes came back: its prefill no longer queues others."""
        with self._lock:
            if not t.first_seen:
                t.first_seen = True
                t.instance.owed_tokens -= t.owed

    def done(self, t: Ticket) -> None:
        self.first_token(t)
        with self._lock:
            t.instance.inflight -= 1

    def failed(self, inst: Instance, why: str) -> None:
        """A request to ``inst`` failed before any answer: out until its /health answers again."""
        with self._lock:
            if inst.healthy:
                inst.healthy, inst.down_since, inst.why = False, time.monotonic(), why

    def health(self, inst: Instance, ok: bool, why: str = "") -> None:
        with self._lock:
            if ok and not inst.healthy:
                inst.healthy, inst.why = True, ""
            elif not ok and inst.healthy:
                inst.healthy, inst.down_since, inst.why = False, time.monotonic(), why

    def status(self) -> list[dict[str, object]]:
        """Each instance (role "prefill" or "decode" in P/D, else "both") as JSON-ready fields."""
        pd = bool(self.decoders)
        roles = [("prefill" if pd else "both", i) for i in self.instances] + [("decode", d) for d in self.decoders]
        with self._lock:
            return [
                {
                    "url": i.url,
                    "role": role,
                    "healthy": i.healthy,
                    "inflight": i.inflight,
                    "owed_tokens": i.owed_tokens,
                    "routed": i.routed,
                    "why": i.why,
                    "cached_blocks": i.cache.held(),
                    "events": i.events,
                }  # fmt: skip
                for role, i in roles
            ]

    def pool_status(self) -> dict[str, object]:
        with self._lock:
            return {
                "pool_blocks": len(self.pool),
                "pool_exact": self.pool.exact,
                "known_blocks": len(self.names),
                "unchained_events": self.names.unchained,
                "skipped_events": self.skipped,
            }
