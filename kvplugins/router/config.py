"""RouterConfig: the one config of ``kvplugins router`` (env ``KVPLUGINS_ROUTER_<FIELD>``)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field

from kvplugins.config import component
from kvplugins.errors import ConfigError


ROUTINGS = ("conductor", "round_robin", "prefix_aware")


@component("router")
@dataclass(frozen=True)
class RouterConfig:
    """Options of the OpenAI-compatible router in front of vLLM or SGLang instances. Times in ms unless named."""

    instances: str = field(
        default="",
        metadata={"help": "comma list of the instances' base URLs (http://host:port); P/D: the prefill instances"},
    )
    decode: str = field(
        default="",
        metadata={
            "help": "P/D disaggregation: comma list of the decode (kv_consumer) instances' base URLs; --instances are "
            "then the prefill (kv_producer) ones; '' = aggregated instances"
        },
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=0, metadata={"help": "port to listen on; 0 = a free port (printed)"})
    port_file: str = field(default="", metadata={"help": "write the listening port here once serving"})
    tokenizer: str = field(
        default="", metadata={"help": "tokenizer (HF name or path) prompts are hashed with; '' = the instances' model"}
    )
    block_tokens: int = field(default=16, metadata={"help": "tokens per KV block, as the engines' --block-size"})
    cache_blocks: int = field(
        default=200000,
        metadata={"help": "blocks the router remembers per instance as cached there (its own routing history, LRU)"},
    )
    prefill_tok_s: float = field(
        default=4000.0, metadata={"help": "prefill tokens/s of one instance: the cost model's rate"}
    )
    routing: str = field(
        default="conductor",
        metadata={
            "help": "conductor (the lowest predicted TTFT), or a baseline to compare it with: round_robin (in turn over "
            "the healthy instances), prefix_aware (the longest prefix the instance's cache holds; ties in turn)"
        },
    )
    slo_ttft_ms: float = field(
        default=0.0,
        metadata={"help": "TTFT SLO: a request no instance is predicted to serve within it gets 429 at once; 0 = off"},
    )
    max_imbalance: int = field(
        default=0,
        metadata={
            "help": "an instance with more than this many requests in flight above the least loaded one is not "
            "chosen, whatever its cache holds; 0 = no bound (the cost model alone)"
        },
    )
    kv_events: str = field(
        default="",
        metadata={
            "help": "comma list of the instances' KV event endpoints, in --instances order (tcp://HOST:PORT, where each "
            "engine publishes: vLLM --kv-events-config endpoint tcp://*:PORT); '' = none: the router's routing "
            "history alone says what each instance caches"
        },
    )
    store_master: str = field(
        default="",
        metadata={
            "help": "the kvplugins store master (HOST:PORT, started with --events-port) whose KV events say exactly "
            "what the shared pool holds; '' = the pages the instances' connectors announce saving"
        },
    )
    engine_hash: str = field(
        default="",
        metadata={
            "help": "compute the engines' own block hashes, so the pool's pages are known without an engine having "
            "announced them: 'vllm:ALGO' (ALGO = the engines' --prefix-caching-hash-algo, vLLM's default sha256; "
            "vLLM must be importable beside the router); '' = learn them from the engines' KV events only"
        },
    )
    load_gbps: float = field(
        default=0.0,
        metadata={"help": "pool -> instance load rate (GB/s) the cost model charges pool hits; 0 = pool hits are free"},
    )
    block_bytes: int = field(
        default=0, metadata={"help": "KV bytes of one block over all layers and TP ranks (the pool load's size)"}
    )
    measure_rates: bool = field(
        default=False,
        metadata={
            "help": "follow the fleet as measured (router/rates.py): every prediction scaled by measured / predicted "
            "TTFT over the last requests, and the pool's load rate from the instances' /metrics (our connector's "
            "load bytes and time, polled with --health-ms); --prefill-tok-s and --load-gbps are the starting values"
        },
    )
    timeout_s: float = field(default=600.0, metadata={"help": "limit of each upstream request (s)"})
    health_ms: float = field(default=1000.0, metadata={"help": "how often each instance's /health is polled"})

    def __post_init__(self) -> None:
        urls = self.urls()
        if not urls:
            raise ConfigError("router --instances is empty: give the engines' base URLs, e.g. http://127.0.0.1:8100")
        for flag, listed in (("--instances", urls), ("--decode", self.decode_urls())):
            bad = [u for u in listed if urllib.parse.urlsplit(u).scheme != "http" or not urllib.parse.urlsplit(u).port]
            if bad:
                raise ConfigError(f"router {flag} {bad}: use http://HOST:PORT")
        if (
            self.block_tokens < 1
            or self.cache_blocks < 0
            or not self.prefill_tok_s > 0
            or self.slo_ttft_ms < 0
            or self.max_imbalance < 0
            or self.load_gbps < 0
            or self.block_bytes < 0
        ):
            raise ConfigError(
                f"router: --block-tokens {self.block_tokens} >= 1, --cache-blocks {self.cache_blocks} >= 0, "
                f"--prefill-tok-s {self.prefill_tok_s} > 0, --slo-ttft-ms {self.slo_ttft_ms} >= 0 and "
                f"--max-imbalance {self.max_imbalance} >= 0, --load-gbps {self.load_gbps} >= 0 and "
                f"--block-bytes {self.block_bytes} >= 0"
            )
        feeds = self.event_endpoints()
        if feeds and len(feeds) != len(urls):
            raise ConfigError(
                f"router --kv-events has {len(feeds)} endpoints for {len(urls)} --instances: give one per instance, "
                "in the same order"
            )
        if self.routing not in ROUTINGS:
            raise ConfigError(f"router --routing {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if self.slo_ttft_ms and self.routing != "conductor":
            raise ConfigError("router --slo-ttft-ms (early rejection) needs --routing conductor")
        if self.engine_hash and not self.engine_hash.startswith("vllm:"):
            raise ConfigError(f"router --engine-hash {self.engine_hash!r}: use vllm:ALGO (e.g. vllm:sha256) or ''")
        bad = [e for e in feeds if urllib.parse.urlsplit(e).scheme != "tcp" or not urllib.parse.urlsplit(e).port]
        if bad:
            raise ConfigError(f"router --kv-events {bad}: use tcp://HOST:PORT (the engine's publisher)")

    def urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.instances.split(",") if u.strip()]

    def decode_urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.decode.split(",") if u.strip()]

    def event_endpoints(self) -> list[str]:
        return [e.strip() for e in self.kv_events.split(",") if e.strip()]
