"""The Conductor's cost model (Mooncake FAST'25 §5: Conductor picks the prefill instance and the KV cache to reuse
so as to meet the TTFT SLO, and rejects early what it predicts cannot meet it). For one request and each
candidate instance: predicted TTFT (s) = the instance's queue (s) + prefill of the tokens no cache holds
(tokens / ``prefill_tok_s``) + load of the blocks the shared pool holds (bytes / ``load_bytes_s``); blocks in
the instance's own cache cost nothing. The lowest prediction wins; with a TTFT SLO, a request whose lowest
prediction exceeds it is rejected (early rejection: admitting it would miss its SLO and delay everyone behind
it). Used by ``kvplugins replay --routing conductor`` (kvplugins/replay/runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplugins.errors import ConfigError


@dataclass(frozen=True)
class CostModel:
    """Measured rates of one model on one instance type: prefill tokens/s, pool -> instance load bytes/s (0 =
    loads are free), and the block geometry (tokens and full-scale KV bytes per block)."""

    prefill_tok_s: float
    load_bytes_s: float
    block_tokens: int
    block_bytes: int

    def __post_init__(self) -> None:
        if not self.prefill_tok_s > 0 or self.load_bytes_s < 0 or self.block_tokens < 1 or self.block_bytes < 0:
            raise ConfigError(
                f"cost model: prefill_tok_s={self.prefill_tok_s} must be > 0, load_bytes_s={self.load_bytes_s} "
                f">= 0, block_tokens={self.block_tokens} >= 1"
            )

    def service_s(self, prompt_tokens: int, local_blocks: int, pool_blocks: int) -> float:
        """Seconds to serve a prompt of ``prompt_tokens`` on an idle instance whose own cache holds its first
        ``local_blocks`` blocks and the pool the next ``pool_blocks``."""
        cached = min(prompt_tokens, (local_blocks + pool_blocks) * self.block_tokens)
        load = pool_blocks * self.block_bytes / self.load_bytes_s if self.load_bytes_s else 0.0
        return (prompt_tokens - cached) / self.prefill_tok_s + load


@dataclass(frozen=True)
class Candidate:
    """An instance as the Conductor sees it for one request: its queue (s until it could start), how many of the
    request's leading blocks its own cache and then the pool hold, and what its predictions are scaled by."""

    index: int
    queue_s: float
    local_blocks: int
    pool_blocks: int
    scale: float = 1.0  # the instance's measured / predicted TTFT, when the router corrects (router/rates.py)


@dataclass(frozen=True)
class Decision:
    """The chosen instance (``index``; -1: rejected) and its predicted TTFT (s)."""

    index: int
    predicted_s: float

    @property
    def rejected(self) -> bool:
        return self.index < 0


class Conductor:
    """Chooses per request (``choose``); ``slo_s`` > 0 turns early rejection on."""

    def __init__(self, model: CostModel, slo_s: float = 0.0):
        if slo_s < 0:
            raise ConfigError(f"TTFT SLO {slo_s} s must be >= 0 (0: no early rejection)")
        self.model, self.slo_s = model, slo_s

    def predict(self, prompt_tokens: int, c: Candidate) -> float:
        return c.scale * (max(0.0, c.queue_s) + self.model.service_s(prompt_tokens, c.local_blocks, c.pool_blocks))

    def choose(self, prompt_tokens: int, candidates: list[Candidate]) -> Decision:
        """The candidate with the lowest predicted TTFT (ties: the first), or a rejection when an SLO is set and
        even that one would miss it. Raises ConfigError for no candidates."""
        if not candidates:
            raise ConfigError("the Conductor has no instance to choose from")
        best = min(candidates, key=lambda c: self.predict(prompt_tokens, c))
        predicted = self.predict(prompt_tokens, best)
        if self.slo_s and predicted > self.slo_s:
            return Decision(-1, predicted)
        return Decision(best.index, predicted)
