"""``kvplugins replay``'s one config (flag > env KVPLUGINS_REPLAY_* > file [replay] > default)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplugins.config import component, parse_bytes
from kvplugins.errors import ConfigError

ROUTINGS = ("round_robin", "session", "prefix_aware", "conductor")


@component("replay")
@dataclass(frozen=True)
class ReplayConfig:
    model_shape: str = field(
        default="llama3-8b",
        metadata={"help": "KV shape that sizes each block: llama3-8b, llama3-70b, qwen3-30b-a3b or deepseek-v3"},
    )
    layers: int = field(default=0, metadata={"help": "explicit shape instead of --model-shape: layers (> 0)"})
    kv_heads: int = field(default=0, metadata={"help": "explicit shape: KV heads"})
    head_dim: int = field(default=0, metadata={"help": "explicit shape: head dim"})
    kv_dtype: str = field(default="", metadata={"help": "explicit shape: KV dtype ('' = bfloat16)"})
    block_tokens: int = field(default=512, metadata={"help": "tokens per trace block (FAST'25: 512)"})
    scale: int = field(
        default=0,
        metadata={
            "help": "stored objects are the full-scale block bytes / scale (rounded up to 64 B); 0 = auto: ~4 KiB"
        },
    )
    pool_capacity: str = field(
        default="20000",
        metadata={"help": "shared pool size: blocks (20000) or full-scale bytes (1.2TB); the store's segment holds it"},
    )
    sweep: str = field(
        default="",
        metadata={"help": "comma list of pool capacities to replay (each in --pool-capacity's units) for the plot"},
    )
    instances: int = field(default=1, metadata={"help": "engine instances the requests are routed to"})
    local_capacity: str = field(
        default="0",
        metadata={"help": "each instance's own LRU cache in front of the pool: blocks or full-scale bytes; 0 = none"},
    )
    no_pool: bool = field(default=False, metadata={"help": "local caches only, no shared pool"})
    routing: str = field(
        default="round_robin",
        metadata={
            "help": "round_robin, session (sticky per session id, else per the first 4 blocks), prefix_aware "
            "(the instance with the longest local hit) or conductor (the lowest predicted TTFT: queue + prefill "
            "of what no cache holds + pool loads; needs --prefill-tok-s; kvplugins/router/cost.py)"
        },
    )
    realtime: bool = field(
        default=False,
        metadata={
            "help": "issue requests at the trace's arrival times / --speed, reporting put/get latency percentiles "
            "(default: as fast as possible)"
        },
    )
    speed: float = field(default=1.0, metadata={"help": "realtime: the trace's clock runs this many times faster"})
    master: str = field(
        default="",
        metadata={"help": "replay against this running master (host:port); '' = a private embedded store per capacity"},
    )
    miss_on_store_error: bool = field(
        default=False,
        metadata={
            "help": "a store error (master unreachable, timeout) serves that request as a miss and is counted, as the "
            "connectors do; default: it ends the replay"
        },
    )
    limit: int = field(default=0, metadata={"help": "replay only the first N requests (0 = all)"})
    prefill_tok_s: float = field(
        default=0.0,
        metadata={
            "help": "prefill throughput (tokens/s) of one instance: the GPU-time estimate and the TTFT model (a "
            "simulated clock over the trace's arrivals, run --speed times faster); 0 = neither"
        },
    )
    load_gbps: float = field(
        default=10.0,
        metadata={
            "help": "the TTFT model's pool -> instance KV load rate (GB/s, full-scale bytes; 0 = loads are free)"
        },
    )
    slo_ttft_ms: float = field(
        default=0.0,
        metadata={
            "help": "TTFT SLO (ms) of the TTFT model: SLO attainment and goodput are reported against it, and "
            "--routing conductor rejects early what it predicts would miss it; 0 = none"
        },
    )
    json: str = field(default="", metadata={"help": "also write the results as JSON to this file ('-' = stdout)"})
    plot: str = field(
        default="", metadata={"help": "write hit ratio vs pool capacity to this PNG (needs the plot extra: matplotlib)"}
    )
    dry_run: bool = field(default=False, metadata={"help": "print what the run would need and stop"})
    progress: bool = field(default=True, metadata={"help": "a progress bar over the requests (stderr)"})
    synth: bool = field(default=False, metadata={"help": "replay a generated trace (the --synth-* flags)"})
    synth_out: str = field(default="", metadata={"help": "also save the generated trace here (FAST'25 JSONL)"})
    synth_requests: int = field(default=2000, metadata={"help": "synthetic requests"})
    synth_rate: float = field(default=2.0, metadata={"help": "synthetic request rate (requests/s, Poisson)"})
    synth_system_prompts: int = field(default=4, metadata={"help": "distinct system prompts"})
    synth_system_share: float = field(default=0.8, metadata={"help": "share of sessions with a system prompt"})
    synth_system_tokens: int = field(default=2048, metadata={"help": "tokens of each system prompt"})
    synth_turns: float = field(default=3.0, metadata={"help": "mean turns per session (geometric, >= 1)"})
    synth_docs: int = field(default=200, metadata={"help": "documents sessions may quote (Zipf popularity)"})
    synth_doc_share: float = field(default=0.3, metadata={"help": "share of sessions that open with a document"})
    synth_doc_tokens: int = field(default=4096, metadata={"help": "tokens of each document"})
    synth_input_tokens: int = field(default=600, metadata={"help": "mean tokens of a user message (lognormal)"})
    synth_output_tokens: int = field(default=300, metadata={"help": "mean tokens of a reply (lognormal)"})
    synth_seed: int = field(default=0, metadata={"help": "random seed of the generator"})

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ConfigError(f"--routing {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if self.instances < 1 or self.block_tokens < 1 or self.scale < 0 or self.limit < 0:
            raise ConfigError("--instances and --block-tokens must be >= 1, --scale and --limit >= 0")
        if self.speed <= 0 or self.prefill_tok_s < 0:
            raise ConfigError(f"--speed must be > 0 (got {self.speed}) and --prefill-tok-s >= 0")
        if self.load_gbps < 0 or self.slo_ttft_ms < 0:
            raise ConfigError(f"--load-gbps ({self.load_gbps}) and --slo-ttft-ms ({self.slo_ttft_ms}) must be >= 0")
        if (self.routing == "conductor" or self.slo_ttft_ms) and not self.prefill_tok_s:
            raise ConfigError("--routing conductor and --slo-ttft-ms need the TTFT model: give --prefill-tok-s")
        if self.routing == "conductor" and self.realtime:
            raise ConfigError("--routing conductor runs on the TTFT model's simulated clock: drop --realtime")
        self._check_synth()
        if self.no_pool and not self.local_capacity.strip("0 "):
            raise ConfigError("--no-pool needs --local-capacity > 0: without either there is no cache to replay")

    def _check_synth(self) -> None:
        positive = (
            "synth_requests",
            "synth_rate",
            "synth_turns",
            "synth_system_tokens",
            "synth_doc_tokens",
            "synth_input_tokens",
            "synth_output_tokens",
            "synth_docs",
            "synth_system_prompts",
        )
        for name in positive:
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number > 0 (got {value})")
        for name in ("synth_system_share", "synth_doc_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be within 0..1 (got {getattr(self, name)})")
        if self.synth_turns < 1:
            raise ConfigError(f"--synth-turns is a mean of at least 1 turn per session (got {self.synth_turns})")


def capacity_blocks(text: str, block_bytes: int, what: str) -> int:
    """``text`` as blocks: a plain integer is blocks; a size with a unit ("1.2TB") is full-scale bytes.
    Raises ConfigError naming ``what`` and the value."""
    text = str(text).strip()
    if text.isdigit():
        return int(text)
    try:
        return parse_bytes(text) // block_bytes
    except ConfigError:
        raise ConfigError(f"{what} {text!r} is neither a block count (20000) nor a size (1.2TB)") from None
