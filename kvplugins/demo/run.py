"""The demo job: engine A saves multi-turn conversation KV to the store, a fresh engine B reuses it.

Steps: build/reuse the tiny model -> store (a private ``kvplugins up`` stopped at the end, or ``--master``)
-> engine A (fresh process, connector) on turn k of each conversation -> engine B (fresh process, connector)
on turn k+1, whose prompt starts with A's -> engine C (fresh process, no connector) on the same prompts as B.
Report: B's external-hit tokens, TTFT cold (C) vs warm (B), and whether B's greedy tokens equal C's, then one
summary line (``DemoResult.summary``): PASS when B reused stored tokens, its tokens equal C's and its median TTFT
is under half of C's. The model is a random-weight Llama wide enough (hidden 1024, 8 layers, float32) that a
prompt's prefill costs what it costs on a CPU (about 6.5 s for 1,700 tokens on 2 vCPU), so the TTFT ratio shows
what the store saves; ``--model-family llama`` is the tests' tiny one.
"""

from __future__ import annotations

import os
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from kvplugins.config import component
from kvplugins.demo import conversation
from kvplugins.demo.engine import EngineSpec, run_fresh
from kvplugins.demo.model import FAMILY_DIRS, ensure_model
from kvplugins.errors import ConfigError
from kvplugins.store import UpConfig, embedded


@component("demo")
@dataclass(frozen=True)
class DemoConfig:
    """``kvplugins demo`` options."""

    master: str = field(
        default="",
        metadata={
            "help": "store master host:port; '' = a private `kvplugins up` started for the demo and stopped at its end"
        },
    )
    model_family: str = field(
        default="llama-wide",
        metadata={
            "help": "random-weight model to build: llama-wide (hidden 1024, 8 layers: prefill dominates) or llama "
            "(the tests' tiny one)"
        },
    )
    model_dir: str = field(
        default="", metadata={"help": "model directory; '' = ~/.cache/kvplugins/demo-<family>-v1 (built on first use)"}
    )
    conversations: int = field(default=2, metadata={"help": "conversations (one prompt each per engine)"})
    history_turns: int = field(default=2, metadata={"help": "earlier turns in engine A's prompts (2 = ~1,200 tokens)"})
    max_tokens: int = field(default=16, metadata={"help": "greedy tokens generated per prompt"})
    kv_cache_gib: float = field(default=1.0, metadata={"help": "VLLM_CPU_KVCACHE_SPACE of each engine (GiB)"})
    engine_timeout_s: int = field(default=300, metadata={"help": "limit of each engine run (s)"})

    def __post_init__(self):
        if self.model_family not in ("llama", "llama-wide") or self.model_family not in FAMILY_DIRS:
            raise ConfigError(f"--model-family {self.model_family!r}: use llama-wide (the default) or llama")
        if self.conversations < 1 or self.history_turns < 1 or self.max_tokens < 1:
            raise ConfigError("--conversations, --history-turns and --max-tokens must be >= 1")


WIN = 0.5  # PASS needs the warm TTFT under half the cold one


@dataclass
class DemoResult:
    a: dict
    b: dict
    c: dict
    block_size: int = 32  # tokens per KV block (EngineSpec.block_size)

    @property
    def same_tokens(self) -> bool:
        return self.b["tokens"] == self.c["tokens"]

    @property
    def ttft_ratio(self) -> float:
        """Median TTFT of B (warm: from the store) over C's (cold: no connector), over the prompts."""
        return median(self.b["ttft_ms"]) / max(median(self.c["ttft_ms"]), 1e-9)

    @property
    def ok(self) -> bool:
        return self.same_tokens and self.b["external_hit_tokens"] > 0 and self.ttft_ratio < WIN

    def summary(self) -> str:
        """One line: PASS/FAIL, tokens reused, tokens identical, TTFT warm/cold, KV bytes per token and the
        store's load rate (the connector's own counters in B: bytes loaded / seconds of its load batches)."""
        b, kv = self.b, self.b.get("kvplugins", {})
        same = sum(x == y for x, y in zip(b["tokens"], self.c["tokens"]))
        blocks, nbytes, secs = kv.get("loaded_blocks", 0), kv.get("loaded_bytes", 0), kv.get("load_seconds_sum", 0)
        per_token = f"{nbytes / (blocks * self.block_size) / 1024:.0f} KiB" if blocks else "-"
        rate = f"{nbytes / secs / 1e9:.2f} GB/s" if secs else "-"
        return (
            f"{'PASS' if self.ok else 'FAIL'}: {b['external_hit_tokens']:,} of {sum(b['prompt_tokens']):,} "
            f"prompt tokens reused from the store; greedy tokens identical in {same} of {len(b['tokens'])} "
            f"prompts; TTFT warm/cold {self.ttft_ratio:.3f} ({median(b['ttft_ms']):,.0f} vs "
            f"{median(self.c['ttft_ms']):,.0f} ms, median; goal < {WIN}); KV {per_token} per token; "
            f"store load {rate}"
        )


def prompts(cfg: DemoConfig) -> tuple[list[str], list[str]]:
    """(engine A prompts, engine B prompts): B's prompt i is the next turn of A's prompt i."""
    k = cfg.history_turns
    a, b = [], []
    for seed in range(cfg.conversations):
        h = conversation.turns(k + 2, seed=seed)
        a.append(conversation.prompt(h[:k], h[k][0]))
        b.append(conversation.prompt(h[: k + 1], h[k + 1][0]))
    return a, b


def run(cfg: DemoConfig, say=print) -> DemoResult:
    """Run the three engines against the store; ``say`` gets progress lines."""
    model = str(ensure_model(cfg.model_dir or None, family=cfg.model_family))
    say(f"model: {model} (random-weight LlamaForCausalLM, {cfg.model_family}, float32)")
    a_prompts, b_prompts = prompts(cfg)
    with _store(cfg.master, say) as master:
        conn = {"store": {"master": master}}
        spec = dict(model=model, max_tokens=cfg.max_tokens, kv_cache_gib=cfg.kv_cache_gib)
        say("engine A (fresh process, connector): first turns ...")
        a = run_fresh(EngineSpec(prompts=a_prompts, connector=conn, **spec), cfg.engine_timeout_s)
        say("engine B (fresh process, connector): next turns ...")
        b = run_fresh(EngineSpec(prompts=b_prompts, connector=conn, **spec), cfg.engine_timeout_s)
    say("engine C (fresh process, no connector): next turns, cold ...")
    c = run_fresh(EngineSpec(prompts=b_prompts, **spec), cfg.engine_timeout_s)
    return DemoResult(a, b, c)


class _store:
    """Context manager yielding a master address: ``master`` as given, or a private detached ``kvplugins up``
    (own discovery file) that is sent SIGTERM on exit."""

    def __init__(self, master: str, say):
        self.master, self.say, self.tmp, self.pid = master, say, None, None

    def __enter__(self) -> str:
        if self.master:
            self.say(f"store: master {self.master}")
            return self.master
        self.tmp = tempfile.TemporaryDirectory(prefix="kvp-demo-")
        up = UpConfig(discovery_file=str(Path(self.tmp.name, "up.json")))
        address = embedded.ensure_running(config=up)
        self.pid = int(embedded.read_discovery(embedded.discovery_path(up))["pid"])
        self.say(f"store: private `kvplugins up` pid {self.pid}, master {address}")
        return address

    def __exit__(self, *exc) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if self.tmp is not None:
            self.tmp.cleanup()


def report(res: DemoResult) -> str:
    """The demo's summary table (tokens, ms)."""
    lines = [f"{'prompt':>6} {'tokens':>7} {'ttft cold ms':>13} {'ttft warm ms':>13} {'same tokens':>12}"]
    for i, (n, cold, warm) in enumerate(zip(res.b["prompt_tokens"], res.c["ttft_ms"], res.b["ttft_ms"])):
        same = res.b["tokens"][i] == res.c["tokens"][i]
        lines.append(f"{i:>6} {n:>7} {cold:>13.1f} {warm:>13.1f} {str(same):>12}")
    lines.append(
        f"engine B external-hit tokens: {res.b['external_hit_tokens']} "
        f"(of {sum(res.b['prompt_tokens'])} prompt tokens; engine A had {res.a['external_hit_tokens']})"
    )
    lines.append(f"greedy tokens of B (store) == C (no connector): {res.same_tokens}")
    return "\n".join(lines)
