"""TransferConfig: the one config of the transfer core (env ``KVPLUGINS_TRANSFER_<FIELD>``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvplugins.config import Bytes, component, parse_bytes
from kvplugins.errors import ConfigError
from kvplugins.security.limits import ConnLimits

KNOWN_TRANSPORTS = ("shm", "tcp")
MIN_FRAME = 1 << 20


@component("transfer")
@dataclass(frozen=True)
class TransferConfig:
    """Settings of one TransferEngine. Sizes in bytes, times in ms. Invalid values raise ConfigError."""
    host: str = field(default="127.0.0.1", metadata={"help": "address the TCP server binds and advertises"})
    tcp_port: int = field(default=0, metadata={"help": "TCP server port; 0 picks a free port"})
    transports: str = field(default="shm,tcp", metadata={"help": "transports offered, fastest first (shm, tcp)"})
    tcp_connections: int = field(default=4, metadata={"help": "TCP connections per peer; a batch spreads over them"})
    max_frame: Bytes = field(default=Bytes(16 << 20), metadata={"help": "largest TCP frame (header + payload)"})
    timeout_ms: float = field(default=5000.0, metadata={"help": "default deadline of one batch"})
    workers: int = field(default=2, metadata={"help": "engine threads running submit_* batches"})
    copy_threads: int = field(default=1, metadata={"help": "threads of one shared-memory batch copy"})
    shm_backend: str = field(default="memfd", metadata={"help": "alloc_shared backing: memfd or posix"})
    max_connections: int = field(default=4096, metadata={
        "help": "TCP server connections open at once; more are refused with the reason (0 = unlimited)"})
    max_connections_per_peer: int = field(default=1024, metadata={
        "help": "TCP server connections open at once from one peer host (0 = unlimited)"})
    idle_timeout_ms: float = field(default=600000.0, metadata={
        "help": "a TCP server connection with no request this long is closed (clients reconnect; 0 = never)"})
    frame_timeout_ms: float = field(default=0.0, metadata={
        "help": "a TCP frame (or handshake) started, and its reply, must complete within this; 0 = twice "
                "timeout_ms, at least 1 s"})

    def __post_init__(self) -> None:
        if isinstance(self.max_frame, str):  # direct construction may say "16MiB" (load() parses already)
            object.__setattr__(self, "max_frame", Bytes(parse_bytes(self.max_frame)))
        names = self.transport_list()
        bad = [n for n in names if n not in KNOWN_TRANSPORTS]
        if not names or bad or len(set(names)) != len(names):
            raise ConfigError(f"transfer transports={self.transports!r}: give a comma list of distinct names "
                              f"from {', '.join(KNOWN_TRANSPORTS)}, e.g. 'shm,tcp'")
        _at_least("tcp_connections", self.tcp_connections, 1)
        _at_least("workers", self.workers, 1)
        _at_least("copy_threads", self.copy_threads, 1)
        _at_least("max_frame", self.max_frame, MIN_FRAME)
        if not 0 <= self.tcp_port <= 65535:
            raise ConfigError(f"transfer tcp_port={self.tcp_port}: use 0 (any free port) .. 65535")
        if not self.timeout_ms > 0:
            raise ConfigError(f"transfer timeout_ms={self.timeout_ms}: use a positive number of milliseconds")
        if self.shm_backend not in ("memfd", "posix"):
            raise ConfigError(f"transfer shm_backend={self.shm_backend!r}: use 'memfd' or 'posix'")
        _at_least("max_connections", self.max_connections, 0)
        _at_least("max_connections_per_peer", self.max_connections_per_peer, 0)
        for name in ("idle_timeout_ms", "frame_timeout_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"transfer {name}={value!r}: use a number of milliseconds >= 0 (0 = "
                                  f"{'never' if name == 'idle_timeout_ms' else 'twice timeout_ms'})")

    def server_limits(self) -> ConnLimits:
        """The TCP server's connection caps and timeouts (seconds), kvplugins/security/limits.py."""
        frame_ms = self.frame_timeout_ms or max(1000.0, 2 * self.timeout_ms)
        return ConnLimits(self.max_connections, self.max_connections_per_peer, self.idle_timeout_ms / 1000,
                          frame_ms / 1000)

    def transport_list(self) -> list[str]:
        """The transport names in preference order (fastest first)."""
        return [t.strip() for t in self.transports.split(",") if t.strip()]


def _at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise ConfigError(f"transfer {name}={value!r}: use an integer >= {low}")
