"""Options of the vLLM connector, given as ``kv_connector_extra_config`` (or env KVPLUGINS_VLLM_<FIELD>,
or the ``[vllm]`` table of the KVPLUGINS_CONFIG file). Precedence: extra_config > env > file > default."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kvplugins.config import component, load
from kvplugins.errors import ConfigError


@component("vllm")
@dataclass(frozen=True)
class VllmConnectorConfig:
    """How the connector reaches the store. Times in milliseconds."""
    master: str = field(default="", metadata={
        "help": "master host:port of a store cluster; '' = the embedded store (`kvplugins up`, started if absent)"})
    rpc_timeout_ms: int = field(default=1000, metadata={"help": "timeout of each master RPC"})
    transfer_timeout_ms: int = field(default=10000, metadata={"help": "timeout of each page transfer batch"})
    retry_ms: int = field(default=5000, metadata={"help": "after a store failure, serve without it this long"})
    transports: str = field(default="shm,tcp", metadata={"help": "transports offered, fastest first"})
    model_id: str = field(default="", metadata={
        "help": "model name in page keys; '' = vLLM's model path. Set it when hosts load one model from different paths"})
    save: bool = field(default=True, metadata={"help": "save newly computed full pages to the store"})
    load: bool = field(default=True, metadata={"help": "load stored prefix pages instead of computing them"})
    namespace_file: str = field(default="", metadata={
        "help": "write this engine's page-key namespaces here (JSON: rank -> namespace) for tooling; '' = none"})

    def __post_init__(self):
        for name in ("rpc_timeout_ms", "transfer_timeout_ms", "retry_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kv_connector_extra_config {name}={getattr(self, name)} must be > 0 ms")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "VllmConnectorConfig":
        """Build from vLLM's kv_connector_extra_config; unknown keys raise ConfigError naming the valid ones."""
        return load(cls, flags=dict(extra or {}))

    def client_factory(self):
        """() -> StoreClient for this config; the embedded store is discovered or started on first call."""
        def make():
            from kvplugins.store import ClientConfig, StoreClient
            master = self.master
            if not master:
                from kvplugins.store import embedded
                master = embedded.ensure_running()
            return StoreClient(ClientConfig(master=master, rpc_timeout_ms=self.rpc_timeout_ms,
                                            transfer_timeout_ms=self.transfer_timeout_ms,
                                            transports=self.transports))
        return make
