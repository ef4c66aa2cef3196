"""Configuration of the SGLang HiCache backend: ``[sglang]`` in a config file, env ``KVPLUGINS_SGLANG_<FIELD>``,
and, highest, the keys of ``--hicache-storage-backend-extra-config`` (precedence extra_config > env > file >
default, by kvplugins.config.load). SGLang's own keys in that JSON (backend_name, module_path, class_name,
interface_v1) are set aside before loading; any other unknown key raises ConfigError listing the valid keys.
How a rank reaches the store is one nested ``store`` section, a StoreClient's own ClientConfig (``{"store":
{"master": "host:port", "segment_size": "4GiB"}}``, env KVPLUGINS_CLIENT_<FIELD>, the file's ``[sglang.store]``
over ``[client]`` table), the same section the vLLM connector takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from kvplugins.config import component, load
from kvplugins.errors import ConfigError
from kvplugins.store.config import ClientConfig

# Keys SGLang's StorageBackendFactory reads from extra_config itself (the "dynamic" backend) — not ours.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")


@component("sglang")
@dataclass(frozen=True)
class HiCacheConfig:
    """The kvplugins L3 store as seen from one SGLang rank. Times in ms, sizes in bytes ("4GiB" accepted)."""

    store: ClientConfig = field(
        default_factory=ClientConfig,
        metadata={
            "help": "the StoreClient's settings (ClientConfig: master, rpc_timeout_ms, transfer_timeout_ms, "
            "segment_size (DRAM this rank contributes; 0 = none), replicas, host, transports, ...); master "
            "'' = the embedded store (a running `kvplugins up`, started if none)"
        },
    )
    retry_ms: int = field(
        default=5000,
        metadata={"help": "after a store failure, serve without the store (misses) this long before reconnecting"},
    )
    namespace: str = field(
        default="", metadata={"help": "extra tag in every key (isolates tenants or deployments sharing one store)"}
    )

    def __post_init__(self):
        if self.retry_ms <= 0:
            raise ConfigError(f"sglang option retry_ms={self.retry_ms} must be > 0")


def from_extra_config(
    extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> HiCacheConfig:
    """HiCacheConfig from SGLang's extra_config dict (its own keys skipped), env and config file.
    Raises ConfigError naming an unknown key and listing the valid ones."""
    ours = {k: v for k, v in (extra_config or {}).items() if k not in SGLANG_KEYS}
    valid = [f.name for f in fields(HiCacheConfig)]
    client = {f.name for f in fields(ClientConfig)}  # load() names the store section for these
    unknown = sorted(set(ours) - set(valid) - client)
    if unknown:
        raise ConfigError(
            f"--hicache-storage-backend-extra-config: unknown key(s) {', '.join(unknown)}; valid keys: "
            f"{', '.join(valid)} (and SGLang's own: {', '.join(SGLANG_KEYS)})"
        )
    return load(HiCacheConfig, ours, environ=environ)
