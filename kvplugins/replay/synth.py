"""Synthetic traces for users with no trace of their own (``kvplugins replay --synth``).

Sessions arrive as a Poisson process; each has a geometric number of turns (mean ``synth_turns``) spaced by
exponential think times (mean 30 s). A session may open with one of a few system prompts and quote a document
(Zipf-popular among ``synth_docs``); each turn appends a user message and, once answered, the reply (lognormal
lengths). A request's prompt is system prompt + document + the earlier turns + the new message, cut into blocks of
``block_tokens`` whose ids chain over the prefix (equal ids mean an equal prefix, as in the FAST'25 trace), so
sessions share their system prompt and document blocks and each turn reuses the whole previous conversation.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random

from kvplugins.replay.trace import Request

THINK_S = 30.0


def generate(cfg) -> list[Request]:
    """``cfg.synth_requests`` requests (a ReplayConfig), sorted by arrival; deterministic for ``synth_seed``."""
    rng = random.Random(cfg.synth_seed)
    zipf = [1 / (k + 1) for k in range(max(cfg.synth_docs, 1))]
    session_rate, n = cfg.synth_rate / max(cfg.synth_turns, 1.0), cfg.synth_requests
    out, t, sid = [], 0.0, 0
    while True:
        t += rng.expovariate(session_rate)
        # sessions start in time order and arrive no earlier than they start: once the n-th earliest arrival so
        # far precedes this start, no later session changes the first n
        if len(out) >= n and t * 1000 > heapq.nsmallest(n, (r.timestamp_ms for r in out))[-1]:
            break
        out.extend(_session(rng, cfg, sid, t, zipf))
        sid += 1
    out.sort(key=lambda r: r.timestamp_ms)
    return out[:n]


def _session(rng: random.Random, cfg, sid: int, start_s: float, zipf: list[float]) -> list[Request]:
    segments = []  # (content id, tokens) of the conversation so far
    if rng.random() < cfg.synth_system_share:
        segments.append((f"sys{rng.randrange(max(cfg.synth_system_prompts, 1))}", cfg.synth_system_tokens))
    if cfg.synth_docs and rng.random() < cfg.synth_doc_share:
        segments.append((f"doc{rng.choices(range(len(zipf)), zipf)[0]}", cfg.synth_doc_tokens))
    turns = (
        1 + int(math.log(1 - rng.random()) / math.log(1 - 1 / max(cfg.synth_turns, 1.0))) if cfg.synth_turns > 1 else 1
    )
    out, t = [], start_s
    for k in range(turns):
        segments.append((f"s{sid}u{k}", _lognormal(rng, cfg.synth_input_tokens)))
        reply = _lognormal(rng, cfg.synth_output_tokens)
        out.append(
            Request(t * 1000, sum(n for _, n in segments), reply, tuple(_blocks(segments, cfg.block_tokens)), f"s{sid}")
        )
        segments.append((f"s{sid}a{k}", reply))
        t += rng.expovariate(1 / THINK_S)
    return out


def _lognormal(rng: random.Random, mean: float, sigma: float = 0.8) -> int:
    return max(1, int(rng.lognormvariate(math.log(max(mean, 1)) - sigma * sigma / 2, sigma)))


def _blocks(segments, block_tokens: int) -> list[int]:
    """Ids of the full and partial blocks of the concatenated segments, each chained over its predecessor."""
    ids, prev, filled, parts = [], b"", 0, []
    for name, n in segments:
        off = 0
        while off < n:
            take = min(n - off, block_tokens - filled)
            parts.append(f"{name}:{off}:{take}")
            off, filled = off + take, filled + take
            if filled == block_tokens:
                prev = _chain(prev, parts)
                ids.append(int.from_bytes(prev, "little"))
                filled, parts = 0, []
    if parts:
        ids.append(int.from_bytes(_chain(prev, parts), "little"))
    return ids


def _chain(prev: bytes, parts: list[str]) -> bytes:
    return hashlib.blake2b(prev + "|".join(parts).encode(), digest_size=7).digest()
