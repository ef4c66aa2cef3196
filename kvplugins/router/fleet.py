"""What ``kvplugins router`` knows of its instances and how it picks one (kvplugins/router/cost.py's Conductor).

Per instance: healthy or not (its /health, and whether a request to it failed), requests in flight and the prefill
tokens they still owe (the queue: those tokens / prefill_tok_s), and the blocks it holds, as the router's own
routing history says (an LRU of chained block hashes, like SGLang's router's approximate tree: a prompt routed
there left its blocks in that engine's prefix cache). A prompt is hashed as the engines hash theirs: tokens in
blocks of ``block_tokens``, each block's id chained on the previous one, full blocks only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import xxhash

from kvplugins.replay.caches import LocalLRU
from kvplugins.router.config import RouterConfig
from kvplugins.router.cost import Candidate, Conductor, CostModel, Decision


def block_ids(tokens: list[int], block_tokens: int) -> list[int]:
    """Chained ids of the full blocks of ``tokens`` (block i's id covers tokens [0, (i+1) * block_tokens))."""
    out, prev = [], 0
    for i in range(len(tokens) // block_tokens):
        chunk = tokens[i * block_tokens : (i + 1) * block_tokens]
        prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in chunk))
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


@dataclass
class Ticket:
    """One routed request: its instance, the prefill tokens it owes until its first token, the prediction."""

    instance: Instance
    owed: int
    predicted_s: float
    started: float = field(default_factory=time.monotonic)
    first_seen: bool = False


class Fleet:
    """The instances of ``cfg`` and the Conductor over them. Thread-safe."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.instances = [Instance(u, LocalLRU(cfg.cache_blocks)) for u in cfg.urls()]
        model = CostModel(cfg.prefill_tok_s, 0.0, cfg.block_tokens, 0)
        self.conductor = Conductor(model, cfg.slo_ttft_ms / 1000)
        self._lock = threading.Lock()

    def choose(self, prompt_tokens: int, blocks: list[int], exclude: set[str]) -> tuple[Decision, Ticket | None]:
        """The Conductor's decision over the healthy instances not in ``exclude`` and, unless it rejected, the
        request's ticket (the instance's queue and cache updated). Decision.index -1 and no ticket: rejected, or
        (predicted_s = inf) no instance to try."""
        with self._lock:
            live = [(i, inst) for i, inst in enumerate(self.instances) if inst.healthy and inst.url not in exclude]
            live.sort(key=lambda p: (p[1].inflight, p[1].routed))  # equal predictions: the least used first
            if not live:
                return Decision(-1, float("inf")), None
            if self.cfg.max_imbalance:  # no instance more than max_imbalance requests above the least loaded
                least = live[0][1].inflight
                live = [(i, inst) for i, inst in live if inst.inflight <= least + self.cfg.max_imbalance]
            cands = [
                Candidate(i, inst.owed_tokens / self.cfg.prefill_tok_s, inst.cache.prefix(blocks), 0)
                for i, inst in live
            ]
            d = self.conductor.choose(prompt_tokens, cands)
            if d.rejected:
                return d, None
            inst = self.instances[d.index]
            cached = min(prompt_tokens, inst.cache.prefix(blocks) * self.cfg.block_tokens)
            inst.cache.admit(blocks)
            inst.inflight += 1
            inst.routed += 1
            inst.owed_tokens += prompt_tokens - cached
            return d, Ticket(inst, prompt_tokens - cached, d.predicted_s)

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
        with self._lock:
            return [
                {
                    "url": i.url,
                    "healthy": i.healthy,
                    "inflight": i.inflight,
                    "owed_tokens": i.owed_tokens,
                    "routed": i.routed,
                    "why": i.why,
                }  # fmt: skip
                for i in self.instances
            ]
