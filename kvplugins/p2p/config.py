"""P2PConfig: the one config of a P2P store peer (env ``KVPLUGINS_P2P_<FIELD>``, flags of ``kvplugins p2p``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplugins.config import Bytes, component, parse_bytes
from kvplugins.errors import ConfigError

MIN_CHUNK = 64 << 10


@component("p2p")
@dataclass(frozen=True)
class P2PConfig:
    """Settings of one P2PStore (kvplugins/p2p/store.py). Sizes in bytes, times in ms. Invalid values raise
    ConfigError naming the field."""

    etcd: str = field(
        default="",
        metadata={"help": "the etcd holding the catalog: etcd://host:port[,host:port][/prefix] (required)"},
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "address this peer's transfer server binds and advertises (another host: its own IP)"},
    )
    transports: str = field(
        default="",
        metadata={
            "help": "transports offered and used, fastest first; empty: the transfer core's (KVPLUGINS_TRANSFER_)"
        },
    )
    chunk_bytes: Bytes = field(
        default=Bytes(64 << 20),
        metadata={"help": "an object is cut into chunks of this size (per buffer), each checksummed and pulled whole"},
    )
    parallel: int = field(default=4, metadata={"help": "chunks one get_replica pulls at once"})
    lease_ttl_s: int = field(
        default=10,
        metadata={"help": "a peer's holdings vanish from the catalog this long after it stops refreshing them"},
    )
    chunk_timeout_ms: float = field(default=60000.0, metadata={"help": "deadline of one chunk's read from one peer"})
    stall_timeout_ms: float = field(
        default=30000.0,
        metadata={"help": "get_replica fails when no live peer holds a missing chunk for this long"},
    )
    sources: str = field(
        default="peers",
        metadata={
            "help": "whom a pull reads from: peers (every holder, replicas first) or owner (only the registering "
            "peer: what a pull costs without P2P, the benchmark's baseline)"
        },
    )
    refresh_ms: float = field(
        default=200.0, metadata={"help": "how often a pull reads who holds which chunks (at most)"}
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk_bytes", Bytes(parse_bytes(self.chunk_bytes)))
        checks = {
            "chunk_bytes": self.chunk_bytes >= MIN_CHUNK,
            "parallel": 1 <= self.parallel <= 64,
            "lease_ttl_s": 2 <= self.lease_ttl_s <= 3600,
            "chunk_timeout_ms": self.chunk_timeout_ms > 0,
            "stall_timeout_ms": self.stall_timeout_ms > 0,
            "refresh_ms": self.refresh_ms >= 0,
            "sources": self.sources in ("peers", "owner"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            name = bad[0]
            raise ConfigError(
                f"p2p {name}={getattr(self, name)!r} is out of range: chunk_bytes >= {MIN_CHUNK}, parallel 1..64, "
                "lease_ttl_s 2..3600, the timeouts > 0, refresh_ms >= 0, sources peers or owner"
            )
