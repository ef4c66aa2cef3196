"""TransferConfig: the one config of the transfer core (env ``KVPLUGINS_TRANSFER_<FIELD>``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplugins.config import Bytes, component, load, parse_bytes
from kvplugins.errors import ConfigError
from kvplugins.security.limits import ConnLimits

KNOWN_TRANSPORTS = ("shm", "cma", "rdma", "tcp")
MIN_FRAME = 1 << 20


@component("transfer")
@dataclass(frozen=True)
class TransferConfig:
    """Settings of one TransferEngine. Sizes in bytes, times in ms. Invalid values raise ConfigError."""

    host: str = field(default="127.0.0.1", metadata={"help": "address the TCP server binds and advertises"})
    tcp_port: int = field(default=0, metadata={"help": "TCP server port; 0 picks a free port"})
    transports: str = field(
        default="shm,cma,rdma,tcp",
        metadata={
            "help": "transports offered, fastest first (shm, cma, rdma, tcp); cma (same-host copies out of a peer's "
            "own memory) is dropped where the kernel lacks process_vm_readv, rdma, with one log line saying "
            "why, where this host has no usable RDMA NIC or no libibverbs"
        },
    )
    tcp_connections: int = field(default=4, metadata={"help": "TCP connections per peer; a batch spreads over them"})
    max_frame: Bytes = field(default=Bytes(16 << 20), metadata={"help": "largest TCP frame (header + payload)"})
    timeout_ms: float = field(default=5000.0, metadata={"help": "default deadline of one batch"})
    workers: int = field(default=2, metadata={"help": "engine threads running submit_* batches"})
    copy_threads: int = field(
        default=0,
        metadata={
            "help": "threads of one shared-memory batch copy of >= 4 MiB (smaller ones use one); 0 = the usable "
            "cores, at most 4 (two threads reached memcpy speed with the fused checksum: docs/benchmarks.md)"
        },
    )
    shm_backend: str = field(
        default="memfd",
        metadata={
            "help": "alloc_shared backing: memfd (sealed, handed to same-host peers as an fd) or posix (a /dev/shm "
            "file; cannot be sealed, so same-host peers reach it over TCP)"
        },
    )
    max_connections: int = field(
        default=4096,
        metadata={"help": "TCP server connections open at once; more are refused with the reason (0 = unlimited)"},
    )
    max_connections_per_peer: int = field(
        default=1024, metadata={"help": "TCP server connections open at once from one peer host (0 = unlimited)"}
    )
    idle_timeout_ms: float = field(
        default=600000.0,
        metadata={"help": "a TCP server connection with no request this long is closed (clients reconnect; 0 = never)"},
    )
    frame_timeout_ms: float = field(
        default=0.0,
        metadata={
            "help": "a TCP frame (or handshake) started, and its reply, must complete within this; 0 = twice "
            "timeout_ms, at least 1 s"
        },
    )

    device_emulation: bool = field(
        default=False,
        metadata={
            "help": "Mooncake TE register_memory with location 'cuda:N' or '*' registers host memory as emulated "
            "device memory, copied the way a GPU's is (staged through host buffers): tests without a GPU"
        },
    )

    rdma_devices: str = field(
        default="", metadata={"help": "RDMA devices to use, comma list (e.g. mlx5_0,mlx5_1); empty = every usable one"}
    )
    rdma_qps_per_peer: int = field(
        default=2, metadata={"help": "RC queue pairs per peer and NIC path; a large batch spreads over them"}
    )
    rdma_max_wr: Bytes = field(
        default=Bytes(1 << 20), metadata={"help": "largest RDMA work request; longer spans are split (bytes)"}
    )
    rdma_queue_depth: int = field(default=128, metadata={"help": "RDMA work requests outstanding per QP"})
    rdma_signal_every: int = field(
        default=16, metadata={"help": "selective signalling: one completion per this many work requests (and the last)"}
    )
    rdma_probe_ms: float = field(
        default=1000.0,
        metadata={"help": "how often a failed RDMA NIC or queue pair is probed and rebuilt in the background"},
    )

    def __post_init__(self) -> None:
        for name in ("max_frame", "rdma_max_wr"):
            if isinstance(getattr(self, name), str):  # direct construction may say "16MiB" (load() parses already)
                object.__setattr__(self, name, Bytes(parse_bytes(getattr(self, name))))
        names = self.transport_list()
        bad = [n for n in names if n not in KNOWN_TRANSPORTS]
        if not names or bad or len(set(names)) != len(names):
            raise ConfigError(
                f"transfer transports={self.transports!r}: give a comma list of distinct names "
                f"from {', '.join(KNOWN_TRANSPORTS)}, e.g. 'shm,cma,rdma,tcp'"
            )
        if "rdma" in names and "tcp" not in names:
            raise ConfigError(
                f"transfer transports={self.transports!r}: rdma sets up its queue pairs over the "
                "tcp transport's server and falls back to it; add tcp, e.g. 'rdma,tcp'"
            )
        _at_least("tcp_connections", self.tcp_connections, 1)
        _at_least("workers", self.workers, 1)
        _at_least("copy_threads", self.copy_threads, 0)
        _at_least("max_frame", self.max_frame, MIN_FRAME)
        _at_least("rdma_qps_per_peer", self.rdma_qps_per_peer, 1)
        _at_least("rdma_max_wr", self.rdma_max_wr, 4096)
        _at_least("rdma_queue_depth", self.rdma_queue_depth, 2)
        _at_least("rdma_signal_every", self.rdma_signal_every, 1)
        if self.rdma_max_wr > 1 << 30:
            raise ConfigError(
                f"transfer rdma_max_wr={self.rdma_max_wr}: at most 1 GiB (one work request's length "
                "is a u32 and NICs cap a message at 2 GiB)"
            )
        if self.rdma_signal_every > self.rdma_queue_depth // 2:
            raise ConfigError(
                f"transfer rdma_signal_every={self.rdma_signal_every}: at most half of "
                f"rdma_queue_depth ({self.rdma_queue_depth}) so the send queue never fills unsignalled"
            )
        if not self.rdma_probe_ms > 0:
            raise ConfigError(f"transfer rdma_probe_ms={self.rdma_probe_ms}: use a positive number of milliseconds")
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
                raise ConfigError(
                    f"transfer {name}={value!r}: use a number of milliseconds >= 0 (0 = "
                    f"{'never' if name == 'idle_timeout_ms' else 'twice timeout_ms'})"
                )

    def server_limits(self) -> ConnLimits:
        """The TCP server's connection caps and timeouts (seconds), kvplugins/security/limits.py."""
        frame_ms = self.frame_timeout_ms or max(1000.0, 2 * self.timeout_ms)
        return ConnLimits(
            self.max_connections, self.max_connections_per_peer, self.idle_timeout_ms / 1000, frame_ms / 1000
        )

    def transport_list(self) -> list[str]:
        """The transport names in preference order (fastest first)."""
        return [t.strip() for t in self.transports.split(",") if t.strip()]


def transfer_config(**given) -> TransferConfig:
    """The TransferConfig of a component's engine: ``given`` (its own host, transports, timeout) over
    KVPLUGINS_TRANSFER_* env over the config file's [transfer] table over defaults (kvplugins.config.load), so
    an operator sets e.g. transports or rdma_devices once for nodes, clients and adapters. A given ``""`` is
    unset (a component's setting left empty: the transfer setting applies), so a component's default never
    overrides the environment or the file. Raises ConfigError."""
    return load(TransferConfig, {k: v for k, v in given.items() if v != ""})


def _at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise ConfigError(f"transfer {name}={value!r}: use an integer >= {low}")
