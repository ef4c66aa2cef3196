"""One frozen config per store component: the master, a store node, a client, and ``kvplugins up``.

Flags (``--field-name``), env vars (``KVPLUGINS_<COMPONENT>_<FIELD>``) and config-file tables derive from
these fields (kvplugins.config). Times are in milliseconds, sizes in bytes (``Bytes`` accepts "4GiB").
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from kvplugins.config import Bytes, component, parse_bytes
from kvplugins.errors import ConfigError
from kvplugins.security.limits import ConnLimits
from kvplugins.store.placement import from_client

SHARD_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _sizes(cfg) -> None:
    """Let direct construction take "4GiB" strings for Bytes fields too (``load`` already parses them)."""
    for f in dataclasses.fields(cfg):
        if f.type in (Bytes, "Bytes"):
            object.__setattr__(cfg, f.name, Bytes(parse_bytes(getattr(cfg, f.name))))


@dataclass(frozen=True)
class _MetricsLimits:
    """The Prometheus endpoint's connection limits, shared by the master's and a node's config."""

    metrics_max_connections: int = field(
        default=64,
        metadata={"help": "metrics endpoint: connections open at once; more get 503 with the reason (0 = unlimited)"},
    )
    metrics_max_connections_per_peer: int = field(
        default=16, metadata={"help": "metrics endpoint: connections open at once from one peer host (0 = unlimited)"}
    )
    metrics_timeout_ms: int = field(
        default=10000,
        metadata={
            "help": "metrics endpoint: a scrape request must arrive in full, and each reply write complete, within this"
        },
    )

    def metrics_limits(self):
        """The metrics endpoint's ConnLimits (one request per connection: no idle time between requests)."""
        return ConnLimits(
            self.metrics_max_connections, self.metrics_max_connections_per_peer, 0.0, self.metrics_timeout_ms / 1000
        )


@component("master")
@dataclass(frozen=True)
class MasterConfig(_MetricsLimits):
    """The metadata master: object table, segment registry, allocator, eviction (kvplugins/store/master)."""

    host: str = field(default="127.0.0.1", metadata={"help": "address both RPC endpoints bind"})
    port: int = field(default=0, metadata={"help": "raw framed-socket RPC port (the master address); 0 = any"})
    zmq_port: int = field(default=0, metadata={"help": "zmq ROUTER control-plane port; 0 = any"})
    port_file: str = field(default="", metadata={"help": "write 'host:port' of the master here once ready"})
    heartbeat_timeout_ms: int = field(
        default=2000,
        metadata={
            "help": "a segment silent this long is suspect: no new placement, its replicas are not read (nodes beat "
            "every 500 ms; a dead node gets no writes after < 3 s)"
        },
    )
    suspect_grace_ms: int = field(
        default=30000,
        metadata={
            "help": "a suspect segment is removed after this much more silence; a node back within it resumes with "
            "every object, one back later gets its objects back when it re-registers (master/liveness.py)"
        },
    )
    admission_probe_ms: int = field(
        default=5000,
        metadata={
            "help": "a segment registered over RPC gets placement only once the master wrote and read back a 4 KiB "
            "block of it within this time (shm by fd on its host, else TCP; master/admission.py); one that "
            "fails is refused, naming why. 0 = off: segments are trusted unprobed"
        },
    )
    lease_ttl_ms: int = field(default=5000, metadata={"help": "a get protects the object from eviction this long"})
    put_timeout_ms: int = field(default=30000, metadata={"help": "a pending put not committed by then is reclaimed"})
    high_watermark: float = field(default=0.95, metadata={"help": "segment usage fraction that starts eviction"})
    low_watermark: float = field(default=0.85, metadata={"help": "eviction stops at this usage fraction"})
    eviction_grace_ms: int = field(
        default=-1,
        metadata={
            "help": "an object committed less than this long ago is never evicted (watermark sweep or a put's "
            "on-demand eviction: such a put answers StoreFull instead); -1 = lease_ttl_ms"
        },
    )
    alloc_align: int = field(default=64, metadata={"help": "allocation granularity inside a segment (bytes)"})
    max_frame: Bytes = field(default=Bytes(64 << 20), metadata={"help": "largest RPC frame accepted"})
    max_batch: int = field(default=65536, metadata={"help": "most entries (keys, segments) one op may carry"})
    max_key_bytes: int = field(default=4096, metadata={"help": "longest key accepted, in UTF-8 bytes"})
    max_segments: int = field(
        default=4096,
        metadata={"help": "segments registered at once (64 at most per registering process); more are refused"},
    )
    max_pending_puts: int = field(
        default=1 << 20,
        metadata={"help": "puts started and not yet committed, over all clients; put_start past it answers StoreFull"},
    )
    max_pending_puts_per_identity: int = field(
        default=1 << 18,
        metadata={
            "help": "puts started and not yet committed by one named credential (kvplugins credential --name; "
            "master/quotas.py); put_start past it answers StoreFull. The cluster secret is not bounded"
        },
    )
    max_pending_share: float = field(
        default=0.5,
        metadata={
            "help": "fraction of the pool's DRAM one named credential's pending puts and reserved slabs may hold"
        },
    )
    max_segments_per_identity: int = field(
        default=64, metadata={"help": "segments one named node credential may have registered at once"}
    )
    max_connections: int = field(
        default=4096,
        metadata={"help": "raw RPC connections open at once; more are refused with the reason (0 = unlimited)"},
    )
    max_connections_per_identity: int = field(
        default=1024, metadata={"help": "raw RPC connections open at once under one named credential (0 = unlimited)"}
    )
    max_connections_per_peer: int = field(
        default=1024, metadata={"help": "raw RPC connections open at once from one peer host (0 = unlimited)"}
    )
    idle_timeout_ms: int = field(
        default=600000,
        metadata={"help": "a raw RPC connection with no request this long is closed (clients reconnect; 0 = never)"},
    )
    frame_timeout_ms: int = field(
        default=10000,
        metadata={
            "help": "a request frame (or handshake) started must arrive in full within this; a peer that leaves "
            "its replies unread this long is dropped"
        },
    )
    partial_frames_budget: Bytes = field(
        default=Bytes(256 << 20),
        metadata={"help": "bytes of partly received frames held over all connections; past it the largest is dropped"},
    )
    reply_buffer: Bytes = field(
        default=Bytes(8 << 20),
        metadata={"help": "unsent reply bytes per connection above which the master reads no more of its requests"},
    )
    tick_ms: int = field(default=100, metadata={"help": "period of the expiry/eviction sweep"})
    metrics_port: int = field(
        default=-1,
        metadata={
            "help": "Prometheus /metrics port (kvplugins/store/metrics.py); -1 = off, 0 = any free port (logged)"
        },
    )
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "address the metrics endpoint binds"})
    events_port: int = field(
        default=-1,
        metadata={
            "help": "KV events zmq PUB port on --host (objects stored/evicted/removed/offloaded, vLLM's framing; "
            "master/events.py); -1 = off, 0 = any free port (the `info` op reports it)"
        },
    )
    events_replay_port: int = field(
        default=0,
        metadata={
            "help": "KV events replay ROUTER port on --host (a late subscriber asks for the recent window); 0 = any"
        },
    )
    events_buffer: int = field(default=10000, metadata={"help": "KV event batches kept for replay"})
    events_topic: str = field(default="kvplugins", metadata={"help": "topic frame of every KV event message"})
    etcd: str = field(
        default="",
        metadata={
            "help": "etcd client URL(s) (http://127.0.0.1:2379, comma-separated for several members): run as one of "
            "several HA masters (election, metadata persisted in etcd); '' = a single master, no persistence"
        },
    )
    etcd_prefix: str = field(default="/kvplugins/default", metadata={"help": "etcd key prefix of this cluster"})
    etcd_lease_ttl_ms: int = field(
        default=2000, metadata={"help": "leader lease: a dead leader is replaced after about this long"}
    )
    cluster: str = field(
        default="",
        metadata={
            "help": "with --shard: the sharded store this master is one shard of, shards://host:port/prefix (etcd "
            "and a key prefix; kvplugins/store/cluster); '' = not sharded"
        },
    )
    shard: str = field(
        default="",
        metadata={
            "help": "this master's shard id in --cluster (letters, digits, - and _); it joins the ring at start. "
            "With --etcd the shard is an HA pair (default --etcd-prefix: <cluster prefix>/shard/<id>)"
        },
    )
    shard_move_window_ms: int = field(
        default=30000,
        metadata={
            "help": "after this master joins, keys it takes over are still read from their previous shard this long"
        },
    )

    def __post_init__(self):
        _sizes(self)
        if bool(self.cluster) != bool(self.shard):
            raise ConfigError(
                f"master cluster={self.cluster!r} shard={self.shard!r}: a shard needs both, e.g. "
                "--cluster shards://127.0.0.1:2379/kvplugins/pool --shard a"
            )
        if self.shard and not SHARD_ID.fullmatch(self.shard):
            raise ConfigError(f"master shard={self.shard!r}: use 1-64 letters, digits, '-' or '_'")
        if self.shard_move_window_ms < 0:
            raise ConfigError(f"master shard_move_window_ms={self.shard_move_window_ms} must be >= 0")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError(
                f"watermarks low={self.low_watermark} high={self.high_watermark}: "
                "need 0 < low_watermark <= high_watermark <= 1"
            )
        if self.eviction_grace_ms < -1:
            raise ConfigError(f"eviction_grace_ms={self.eviction_grace_ms} must be >= 0 ms, or -1 for lease_ttl_ms")
        if self.alloc_align <= 0 or self.alloc_align & (self.alloc_align - 1):
            raise ConfigError(f"alloc_align={self.alloc_align} must be a power of two, e.g. 64")
        if self.admission_probe_ms < 0:
            raise ConfigError(f"master admission_probe_ms={self.admission_probe_ms} must be >= 0 ms (0 = off)")
        if self.suspect_grace_ms < 0:
            raise ConfigError(f"master suspect_grace_ms={self.suspect_grace_ms} must be >= 0 ms")
        for name in (
            "heartbeat_timeout_ms",
            "lease_ttl_ms",
            "put_timeout_ms",
            "tick_ms",
            "etcd_lease_ttl_ms",
            "frame_timeout_ms",
            "max_batch",
            "max_key_bytes",
            "max_segments",
            "max_pending_puts",
            "partial_frames_budget",
            "reply_buffer",
            "metrics_timeout_ms",
            "max_pending_puts_per_identity",
            "max_segments_per_identity",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"master {name}={getattr(self, name)} must be > 0")
        if self.events_port < -1 or self.events_replay_port < 0 or self.events_buffer <= 0:
            raise ConfigError(
                f"master events_port={self.events_port} (-1 = off, 0 = any), events_replay_port="
                f"{self.events_replay_port} (0 = any) and events_buffer={self.events_buffer} (> 0)"
            )
        if not 0 < self.max_pending_share <= 1:
            raise ConfigError(f"master max_pending_share={self.max_pending_share} must be in (0, 1], e.g. 0.5")
        for name in (
            "max_connections",
            "max_connections_per_peer",
            "idle_timeout_ms",
            "metrics_max_connections",
            "metrics_max_connections_per_peer",
            "max_connections_per_identity",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"master {name}={getattr(self, name)} must be >= 0 (0 = unlimited)")

    def conn_limits(self):
        """The raw RPC endpoint's kvplugins.security.limits.ConnLimits."""
        return ConnLimits(
            self.max_connections,
            self.max_connections_per_peer,
            self.idle_timeout_ms / 1000,
            self.frame_timeout_ms / 1000,
            self.max_connections_per_identity,
        )


@component("store")
@dataclass(frozen=True)
class StoreNodeConfig(_MetricsLimits):
    """A store node: contributes one DRAM segment to the pool (kvplugins/store/node/store_node.py)."""

    master: str = field(
        default="",
        metadata={
            "help": "master address host:port (HA: etcd://host:port/prefix or host:port,host:port); '' = the embedded "
            "`kvplugins up`"
        },
    )
    segment_size: Bytes = field(default=Bytes(1 << 30), metadata={"help": "DRAM this node contributes"})
    host: str = field(default="127.0.0.1", metadata={"help": "address the transfer engine binds"})
    transports: str = field(
        default="",
        metadata={
            "help": "transports offered, fastest first; '' = transfer.transports (KVPLUGINS_TRANSFER_TRANSPORTS, "
            "the file's [transfer] table, else shm,cma,rdma,tcp)"
        },
    )
    heartbeat_interval_ms: int = field(default=500, metadata={"help": "heartbeat period"})
    rpc_timeout_ms: int = field(default=3000, metadata={"help": "timeout of each master RPC"})
    ready_file: str = field(default="", metadata={"help": "write the segment id here once registered"})
    prefault: bool = field(
        default=True, metadata={"help": "commit every segment page at start (no page faults in puts)"}
    )
    metrics_port: int = field(
        default=-1, metadata={"help": "Prometheus /metrics port of this node; -1 = off, 0 = any free port (logged)"}
    )
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "address the metrics endpoint binds"})
    shard_extents: int = field(
        default=12,
        metadata={
            "help": "with a sharded store (--master shards://...): the segment is split in this many equal extents, "
            "spread evenly over the shards (the largest object must fit in one)"
        },
    )
    disk_dir: str = field(default="", metadata={"help": "disk tier directory (offload on evict); '' = no disk tier"})
    disk_capacity: Bytes = field(default=Bytes(0), metadata={"help": "object bytes the disk tier may hold, e.g. 64GiB"})
    disk_poll_ms: int = field(default=50, metadata={"help": "period of the node's disk-tier/drain command poll"})
    disk_threads: int = field(default=4, metadata={"help": "offloads written at once (their fsyncs overlap)"})
    drain: bool = field(
        default=False,
        metadata={
            "help": "do not start a node: drain the node of --segment (migrate its objects) and wait until it left"
        },
    )
    segment: str = field(default="", metadata={"help": "with --drain: the segment name to drain (`kvplugins status`)"})
    drain_timeout_ms: int = field(default=600000, metadata={"help": "with --drain: give up after this long"})
    promote_max_connections: int = field(
        default=1024,
        metadata={
            "help": "disk-tier promote endpoint: connections open at once; more are refused with the reason "
            "(0 = unlimited)"
        },
    )
    promote_max_connections_per_peer: int = field(
        default=256, metadata={"help": "promote endpoint: connections open at once from one peer host (0 = unlimited)"}
    )
    promote_idle_timeout_ms: int = field(
        default=600000,
        metadata={"help": "promote endpoint: a connection with no request this long is closed (0 = never)"},
    )
    promote_frame_timeout_ms: int = field(
        default=10000,
        metadata={
            "help": "promote endpoint: a request frame (or handshake) started, and its reply, must complete within this"
        },
    )
    promote_max_batch: int = field(
        default=65536, metadata={"help": "promote endpoint: most keys one promote request may carry"}
    )

    def __post_init__(self):
        _sizes(self)
        for name in ("promote_frame_timeout_ms", "promote_max_batch", "metrics_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"store {name}={getattr(self, name)} must be > 0")
        for name in (
            "promote_max_connections",
            "promote_max_connections_per_peer",
            "promote_idle_timeout_ms",
            "metrics_max_connections",
            "metrics_max_connections_per_peer",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"store {name}={getattr(self, name)} must be >= 0 (0 = unlimited)")
        if self.segment_size <= 0:
            raise ConfigError(f"segment_size={self.segment_size} must be > 0, e.g. 4GiB")
        if self.disk_dir and self.disk_capacity <= 0:
            raise ConfigError(f"disk_dir={self.disk_dir!r} needs disk_capacity > 0, e.g. --disk-capacity 64GiB")
        if self.drain and not self.segment:
            raise ConfigError("--drain needs --segment NAME (the segment names are in `kvplugins status`)")
        if self.disk_poll_ms <= 0:
            raise ConfigError(f"disk_poll_ms={self.disk_poll_ms} must be > 0 ms")
        if self.shard_extents < 1:
            raise ConfigError(f"shard_extents={self.shard_extents} must be >= 1, e.g. 12")
        if self.master.startswith("shards://") and (self.disk_dir or self.drain or self.metrics_port >= 0):
            raise ConfigError(
                f"master={self.master!r} is a sharded store: a node of it has no disk tier, drain or "
                "metrics endpoint yet (docs/operations.md); drop --disk-dir/--drain/--metrics-port"
            )
        if self.disk_threads < 1:
            raise ConfigError(f"disk_threads={self.disk_threads} must be >= 1")

    def promote_limits(self):
        """The disk-tier promote endpoint's kvplugins.security.limits.ConnLimits."""
        return ConnLimits(
            self.promote_max_connections,
            self.promote_max_connections_per_peer,
            self.promote_idle_timeout_ms / 1000,
            self.promote_frame_timeout_ms / 1000,
        )


@component("client")
@dataclass(frozen=True)
class ClientConfig:
    """A StoreClient (kvplugins/store/client/store_client.py)."""

    master: str = field(
        default="",
        metadata={
            "help": "master host:port (HA: etcd://host:port/prefix or host:port,host:port); '' = discover or start "
            "`kvplugins up`"
        },
    )
    rpc_timeout_ms: int = field(default=3000, metadata={"help": "timeout of each master RPC"})
    transfer_timeout_ms: int = field(default=10000, metadata={"help": "timeout of each transfer batch"})
    segment_size: Bytes = field(default=Bytes(0), metadata={"help": "DRAM this client contributes; 0 = none"})
    staging_size: Bytes = field(default=Bytes(16 << 20), metadata={"help": "initial staging buffer (bytes API)"})
    replicas: int = field(default=1, metadata={"help": "replicas written per put (on distinct segments)"})
    preferred_segment: str = field(
        default="",
        metadata={"help": "segment name that gets a put's first replica when it has room; '' = most free first"},
    )
    pin: str = field(
        default="none",
        metadata={"help": "none | soft (evicted last until pin_ttl_ms after the put) | hard (never evicted)"},
    )
    pin_ttl_ms: int = field(default=60000, metadata={"help": "how long a soft pin lasts"})
    verify_checksums: bool = field(
        default=True,
        metadata={"help": "check each object read against its xxh3_64 checksum (a mismatch reads as a miss)"},
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address this client's transfer engine binds"})
    transports: str = field(
        default="",
        metadata={
            "help": "transports offered, fastest first; '' = transfer.transports (KVPLUGINS_TRANSFER_TRANSPORTS, "
            "the file's [transfer] table, else shm,cma,rdma,tcp)"
        },
    )
    rdma_devices: str = field(
        default="",
        metadata={
            "help": "RDMA devices of this client's engine, comma list; '' = transfer.rdma_devices (every usable one)"
        },
    )
    heartbeat_interval_ms: int = field(default=500, metadata={"help": "heartbeat period of the own segment"})
    segment_poll_ms: int = field(
        default=200,
        metadata={
            "help": "with segment_size: how often the own segment asks the master for commands (replica copy/move "
            "tasks, drain)"
        },
    )
    embedded_start_timeout_ms: int = field(default=30000, metadata={"help": "wait for an auto-started `up`"})
    wait_commit: bool = field(
        default=True,
        metadata={
            "help": "put waits for put_commit's reply; false pipelines the commit (one round trip less per put, but "
            "other clients may miss the key for a moment after put returns; docs/store.md, visibility)"
        },
    )
    pending_wait_ms: int = field(
        default=1000,
        metadata={
            "help": "a put of a key another writer is still putting waits this long for that put to commit, abort "
            "or be reclaimed, then fails with PutPending (never reported as stored)"
        },
    )
    slab_bytes: Bytes = field(
        default=Bytes(16 << 20),
        metadata={
            "help": "space this client reserves from the master at a time for one-round-trip puts of batches up to "
            "this size (at most 1/8 of the largest segment is granted); 0 = put_start + put_commit always"
        },
    )

    def __post_init__(self):
        _sizes(self)
        if self.replicas < 1:
            raise ConfigError(f"replicas={self.replicas} must be >= 1")
        from_client(self)  # validates pin / pin_ttl_ms (raises ConfigError)
        if self.rpc_timeout_ms <= 0 or self.transfer_timeout_ms <= 0:
            raise ConfigError("rpc_timeout_ms and transfer_timeout_ms must be > 0 ms")
        if self.pending_wait_ms < 0:
            raise ConfigError(f"pending_wait_ms={self.pending_wait_ms} must be >= 0 ms")
        if self.segment_poll_ms <= 0:
            raise ConfigError(f"segment_poll_ms={self.segment_poll_ms} must be > 0 ms")


@component("up")
@dataclass(frozen=True)
class UpConfig:
    """``kvplugins up``: the master and one segment in one process (kvplugins/store/embedded.py)."""

    discovery_file: str = field(
        default="",
        metadata={
            "help": "where `up` announces its master; '' = $XDG_RUNTIME_DIR/kvplugins/up.json or a per-user temp dir"
        },
    )
    detach: bool = field(default=False, metadata={"help": "daemonize; return once the store is ready"})
    ready_timeout_ms: int = field(default=30000, metadata={"help": "how long --detach waits for readiness"})
