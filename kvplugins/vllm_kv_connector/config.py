"""Options of the vLLM connector, given as ``kv_connector_extra_config`` (or env KVPLUGINS_VLLM_<FIELD>,
or the ``[vllm]`` table of the KVPLUGINS_CONFIG file). Precedence: extra_config > env > file > default.
How it reaches the store is one nested ``store`` section, a StoreClient's own ClientConfig (extra_config
``{"store": {"master": "host:port"}}``, env KVPLUGINS_CLIENT_<FIELD>, the file's ``[vllm.store]`` over
``[client]`` table), so every client setting has one name in every adapter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kvplugins.config import component, load
from kvplugins.errors import ConfigError
from kvplugins.store import StoreClient
from kvplugins.store.config import ClientConfig


@component("vllm")
@dataclass(frozen=True)
class VllmConnectorConfig:
    """How the connector uses the store. Times in milliseconds."""

    store: ClientConfig = field(
        default_factory=lambda: ClientConfig(rpc_timeout_ms=1000),
        metadata={
            "help": "the StoreClient's settings (ClientConfig: master, rpc_timeout_ms, transfer_timeout_ms, "
            "transports, ...); master '' = the embedded store (`kvplugins up`, started if absent). The "
            "connector's default rpc_timeout_ms is 1000 (a step waits at most that for a down master)"
        },
    )
    retry_ms: int = field(default=5000, metadata={"help": "after a store failure, serve without it this long"})
    model_id: str = field(
        default="",
        metadata={
            "help": "model name in page keys; '' = vLLM's model path. Set it when hosts load one model from different paths"
        },
    )
    save: bool = field(default=True, metadata={"help": "save newly computed full pages to the store"})
    load: bool = field(default=True, metadata={"help": "load stored prefix pages instead of computing them"})
    async_load_tokens: int = field(
        default=256,
        metadata={
            "help": "hits of at least this many tokens load in the background while other requests run "
            "(the request waits in WAITING_FOR_REMOTE_KVS); smaller hits load before the step's forward. "
            "0 = always before the forward"
        },
    )
    pd_mode: str = field(
        default="store",
        metadata={
            "help": "P/D (kv_producer): how decode gets a request's KV: 'store' (the producer saves its pages, decode "
            "loads them) or 'direct' (decode reads the producer's KV blocks through the transfer core)"
        },
    )
    pd_host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "P/D (kv_producer): address this instance's transfer engine binds and advertises (reachable by "
            "decode instances; the direct path reads the KV memory through it)"
        },
    )
    pd_wait_ms: int = field(
        default=5000,
        metadata={
            "help": "P/D store path (consumer): wait this long for the producer's pages to land before computing them"
        },
    )
    pd_hold_ms: int = field(
        default=30000,
        metadata={
            "help": "P/D direct path (producer): free a request's blocks after this long even without the decode ack"
        },
    )
    staging: str = field(
        default="auto",
        metadata={
            "help": "how pages move between the KV cache and the store: 'auto' (straight from CPU KV memory, through "
            "pinned host bounce slots when the KV cache is on a GPU), 'always' (bounce even CPU KV: exercises "
            "the GPU path on a CPU engine), 'never' (refuse a GPU KV cache)"
        },
    )
    bounce_bytes: int = field(
        default=256 << 20,
        metadata={"help": "host bounce memory for staged pages, in bytes (pinned for a GPU; 4 slots of whole pages)"},
    )
    layer_chunks: int = field(
        default=1,
        metadata={
            "help": "store each page as this many objects of consecutive layers, so a load before the forward "
            "(async_load_tokens above the hit) runs layer by layer: the forward of layer l waits only for its "
            "chunk (wait_for_layer_load) while later chunks load. 1 = one object per page, every layer (the "
            "default: measured faster on CPU engines, docs/vllm.md); other values give other page keys"
        },
    )
    namespace_file: str = field(
        default="",
        metadata={
            "help": "write this engine's page-key namespaces here (JSON: rank -> namespace) for tooling; '' = none"
        },
    )

    def __post_init__(self):
        if self.retry_ms <= 0:
            raise ConfigError(f"kv_connector_extra_config retry_ms={self.retry_ms} must be > 0 ms")
        if self.pd_mode not in ("store", "direct"):
            raise ConfigError(f"kv_connector_extra_config pd_mode={self.pd_mode!r}: use 'store' or 'direct'")
        if self.pd_wait_ms < 0 or self.pd_hold_ms <= 0:
            raise ConfigError(
                f"kv_connector_extra_config pd_wait_ms={self.pd_wait_ms} must be >= 0 and "
                f"pd_hold_ms={self.pd_hold_ms} > 0 ms"
            )
        if self.staging not in ("auto", "always", "never"):
            raise ConfigError(f"kv_connector_extra_config staging={self.staging!r}: use 'auto', 'always' or 'never'")
        if self.bounce_bytes <= 0:
            raise ConfigError(
                f"kv_connector_extra_config bounce_bytes={self.bounce_bytes} must be > 0 (default 268435456 = 256 MiB)"
            )
        if self.layer_chunks < 1:
            raise ConfigError(
                f"kv_connector_extra_config layer_chunks={self.layer_chunks} must be >= 1 (1 = one object per page)"
            )
        if self.async_load_tokens < 0:
            raise ConfigError(
                f"kv_connector_extra_config async_load_tokens={self.async_load_tokens} must be >= 0 "
                "(0 = always load before the forward)"
            )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "VllmConnectorConfig":
        """Build from vLLM's kv_connector_extra_config; unknown keys raise ConfigError naming the valid ones."""
        return load(cls, flags=dict(extra or {}))

    def client_factory(self):
        """() -> StoreClient of ``store``; with no master the client discovers (or starts) the embedded store
        on first call, as every StoreClient does."""

        def make():
            return StoreClient(self.store)

        return make
