"""Configuration of the SGLang HiCache backend: ``[sglang]`` in a config file, env ``KVPLUGINS_SGLANG_<FIELD>``,
and, highest, the keys of ``--hicache-storage-backend-extra-config`` (precedence extra_config > env > file >
default, by kvplugins.config.load). SGLang's own keys in that JSON (backend_name, module_path, class_name,
interface_v1) are set aside before loading; any other unknown key raises ConfigError listing the valid keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from kvplugins.config import Bytes, component, load, parse_bytes
from kvplugins.errors import ConfigError

# Keys SGLang's StorageBackendFactory reads from extra_config itself (the "dynamic" backend) — not ours.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")


@component("sglang")
@dataclass(frozen=True)
class HiCacheConfig:
    """The kvplugins L3 store as seen from one SGLang rank. Times in ms, sizes in bytes ("4GiB" accepted)."""
    master: str = field(default="", metadata={
        "help": "master host:port; '' = the embedded store (a running `kvplugins up`, started if none)"})
    rpc_timeout_ms: int = field(default=3000, metadata={"help": "timeout of each master RPC"})
    transfer_timeout_ms: int = field(default=10000, metadata={"help": "timeout of each page transfer batch"})
    segment_size: Bytes = field(default=Bytes(0), metadata={
        "help": "DRAM this SGLang rank contributes to the pool; 0 = none (store nodes hold the pages)"})
    replicas: int = field(default=1, metadata={"help": "replicas written per page (on distinct segments)"})
    transports: str = field(default="", metadata={
        "help": "transports offered, fastest first; '' = transfer.transports (KVPLUGINS_TRANSFER_TRANSPORTS, "
                "the file's [transfer] table, else shm,cma,rdma,tcp)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address this rank's transfer engine binds"})
    retry_ms: int = field(default=5000, metadata={
        "help": "after a store failure, serve without the store (misses) this long before reconnecting"})
    namespace: str = field(default="", metadata={
        "help": "extra tag in every key (isolates tenants or deployments sharing one store)"})

    def __post_init__(self):
        object.__setattr__(self, "segment_size", Bytes(parse_bytes(self.segment_size)))
        for name in ("rpc_timeout_ms", "transfer_timeout_ms", "retry_ms", "replicas"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"sglang option {name}={getattr(self, name)} must be > 0")
        if self.segment_size < 0:
            raise ConfigError(f"sglang option segment_size={self.segment_size} must be >= 0 (0 = none)")

    def client_config(self):
        """The StoreClient config these settings give (imports the store lazily)."""
        from kvplugins.store import ClientConfig
        return ClientConfig(master=self.master, rpc_timeout_ms=self.rpc_timeout_ms,
                            transfer_timeout_ms=self.transfer_timeout_ms, segment_size=self.segment_size,
                            replicas=self.replicas, host=self.host, transports=self.transports)


def from_extra_config(extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
                      ) -> HiCacheConfig:
    """HiCacheConfig from SGLang's extra_config dict (its own keys skipped), env and config file.
    Raises ConfigError naming an unknown key and listing the valid ones."""
    ours = {k: v for k, v in (extra_config or {}).items() if k not in SGLANG_KEYS}
    valid = [f.name for f in fields(HiCacheConfig)]
    unknown = sorted(set(ours) - set(valid))
    if unknown:
        raise ConfigError(f"--hicache-storage-backend-extra-config: unknown key(s) {', '.join(unknown)}; valid keys: "
                          f"{', '.join(valid)} (and SGLang's own: {', '.join(SGLANG_KEYS)})")
    return load(HiCacheConfig, ours, environ=environ)
