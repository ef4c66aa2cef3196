"""Prometheus endpoints (prometheus_client) of the master, of each store node, and of ``kvplugins up``.

Enabled by ``--metrics-port`` (MasterConfig / StoreNodeConfig; -1 = off, the default; 0 = any free port, logged
as ``metrics on http://HOST:PORT/metrics``), bound to ``--metrics-host`` (127.0.0.1 by default). Every series
is named ``kvplugins_*``; the list is in docs/operations.md (Monitoring). Each endpoint caps its connections
(in all and per host: 503 naming the limit), drops scrapers that do not send their request in time and survives
accept() failures (EMFILE...): ``Endpoint``; a node's limits are StoreNodeConfig ``metrics_*``.

Thread safety: the master is one single-threaded selector loop (master/rpc_server.py) and its tables are never
read from another thread. The loop times each dispatched op into an ``OpTimer`` (two perf_counter calls and
plain list increments, ~0.5 µs per batch op, not per key) and, once per sweep (``tick_ms``), publishes an
immutable ``MasterSnapshot`` (a msgpack copy of the ``status`` op's answer plus the latency histograms); the
HTTP thread's collector only reads the latest snapshot reference. A node's collector asks the master's
``status`` op over its own control connection, at most once per ``NODE_CACHE_S``, and reads the node's own
(immutable or thread-safe) fields.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from kvplugins.errors import StoreError
from kvplugins.security.limits import ConnLimits, GuardedServerMixIn
from kvplugins.store.client.connect import control_client
from kvplugins.store.wire import protocol

log = logging.getLogger(__name__)

# Upper bounds (seconds) of the op-latency histogram buckets: the master's dispatch takes ~1-20 µs per key.
LATENCY_BOUNDS = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3)
NODE_CACHE_S = 1.0
# The endpoints' default limits: 64 scrapes at once, 16 from one host, a request in full within 10 s.
METRICS_LIMITS = ConnLimits(max_connections=64, max_per_peer=16, idle_timeout_s=0.0, frame_timeout_s=10.0)
# Disk-tier numbers whose key holds one of these words are counters (*_total), other numbers gauges (the
# master's Tiering names its counters exactly, through ``Tiering.counters``; node stats go by these words).
TIER_COUNTER_WORDS = (
    "offload",
    "promot",
    "error",
    "evict",
    "hit",
    "miss",
    "corrupt",
    "lost",
    "migrat",
    "drain",
    "fail",
    "deferred",
    "writes",
    "reads",
    "deletes",
)


class OpTimer:
    """Latency histogram per master op. Written only by the master's loop thread; ``snapshot()`` copies."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BOUNDS):
        self.bounds = bounds
        self._ops: dict[str, list] = {}

    def record(self, op: str, seconds: float, bisect=bisect_left) -> None:
        """Count one dispatch of ``op`` that took ``seconds``: [count per bucket (the last: beyond every bound),
        sum of seconds]. ~0.5 µs here."""
        try:
            h = self._ops[op]
        except KeyError:
            h = self._ops[op] = [0] * (len(self.bounds) + 1) + [0.0]
        h[bisect(self.bounds, seconds)] += 1
        h[-1] += seconds

    def snapshot(self) -> dict[str, tuple]:
        return {op: tuple(h) for op, h in self._ops.items()}


@dataclass(frozen=True)
class MasterSnapshot:
    status: dict | None  # the ``status`` op's answer (a private copy); None on an HA standby
    counters: tuple  # names of the service's monotonically increasing counters
    ops: dict  # op -> (count per bucket..., count beyond the last bound, sum of seconds)
    bounds: tuple
    tier_counters: tuple = ()  # names of the disk tier's counters (Tiering.counters), if it has any
    server: dict | None = None  # RpcServer.guard_stats(): connections, refusals, accept failures, internal errors


class MasterMetrics:
    """Owned by RpcServer: ``timer`` (always on), and the HTTP endpoint when ``config.metrics_port >= 0``."""

    def __init__(self, server, config):
        self.timer, self._server = OpTimer(), server
        self.snapshot: MasterSnapshot | None = None
        self.endpoint = None
        port = getattr(config, "metrics_port", -1)
        if port >= 0:
            limits = config.metrics_limits() if hasattr(config, "metrics_limits") else None
            self.endpoint = Endpoint(
                getattr(config, "metrics_host", "127.0.0.1"), port, "master", limits, "master.metrics_"
            )
            self.endpoint.registry.register(_Collector(self._families))
            self.publish()

    def publish(self) -> None:
        """Loop thread: take a fresh snapshot for the collector (no-op without an endpoint)."""
        if self.endpoint is None:
            return
        service = self._server.service
        try:
            status = protocol.unpack(protocol.pack(service.handle("status", [], {})))  # deep private copy
        except ValueError:  # an HA standby refuses every op: it reports only that it does not lead
            status = None
        except Exception:  # noqa: BLE001 - metrics must never stop the master's loop
            log.exception("metrics snapshot failed; serving the previous one")
            return
        self.snapshot = MasterSnapshot(
            status,
            tuple(service.counters),
            self.timer.snapshot(),
            self.timer.bounds,
            tuple(getattr(service.tiering, "counters", ())),
            self._server.guard_stats(),
        )

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()

    def _families(self):
        snap = self.snapshot
        return master_families(snap) if snap is not None else []


class NodeMetrics:
    """A store node's endpoint (its own, or the ``up`` process's master endpoint via ``attach``)."""

    def __init__(self, node, master: str, timeout_ms: float = 1000):
        self.node, self.master, self.timeout_ms = node, master, timeout_ms
        self._cached: tuple[float, dict | None] = (0.0, None)
        self._rpc = None
        self._lock = threading.Lock()  # scrapes may run concurrently (one HTTP thread each)
        self.endpoint = None

    def serve(self, host: str, port: int, limits: ConnLimits | None = None) -> "NodeMetrics":
        """Start this node's own endpoint on ``host:port`` under ``limits`` (StoreNodeConfig.metrics_limits())."""
        self.endpoint = Endpoint(host, port, f"store node {self.node.segment.name}", limits, "store.metrics_")
        self.endpoint.registry.register(_Collector(self._families))
        return self

    def attach(self, endpoint: "Endpoint") -> None:
        """Add this node's series to another process-local endpoint (``kvplugins up``)."""
        endpoint.registry.register(_Collector(self._families))

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
        with self._lock:
            if self._rpc is not None:
                self._rpc.close()

    def _master_status(self) -> dict | None:
        with self._lock:
            at, st = self._cached
            if time.monotonic() - at >= NODE_CACHE_S:
                st = self._ask_master()
                self._cached = (time.monotonic(), st)
            return st

    def _ask_master(self) -> dict | None:
        try:
            if self._rpc is None:
                self._rpc = control_client(self.master, self.timeout_ms)
            st = self._rpc.call("status")
        except StoreError as e:  # MasterUnreachable included: the node still reports what it knows
            log.debug("metrics: master status unavailable: %s", e)
            st = None
        return st

    def _families(self):
        return node_families(self.node, self._master_status())


class Endpoint:
    """A Prometheus HTTP endpoint on ``host:port`` (0 = any) with its own registry (process series under
    ``kvplugins_process_*``): prometheus_client's WSGI app on a thread-per-connection server that degrades
    instead of dying (issue #11, kvplugins/security/limits.py). ``limits``: ``max_connections`` in all and
    ``max_per_peer`` per host (over them a scraper gets ``503`` naming the limit), ``frame_timeout_s``: a request
    must arrive in full within it and each reply write complete within it (slowloris; idle_timeout_s is unused:
    one request per connection); accept() failing with EMFILE & co pauses accepting while accepted scrapes are
    served. ``config_prefix`` names the limits' config keys in refusals ("store.metrics_"). Raises OSError if
    the port is taken."""

    def __init__(
        self, host: str, port: int, what: str, limits: ConnLimits | None = None, config_prefix: str = "metrics_"
    ):
        from prometheus_client import CollectorRegistry, ProcessCollector
        from prometheus_client.exposition import make_wsgi_app

        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(namespace="kvplugins", registry=self.registry)
        limits = limits or METRICS_LIMITS
        self._httpd = _HttpServer(host, port, limits, f"the metrics endpoint of {what}", config_prefix)
        self._httpd.set_app(make_wsgi_app(self.registry))
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            name="kvp-metrics",
            daemon=True,
            kwargs={"poll_interval": min(0.5, max(0.01, limits.frame_timeout_s / 4))},
        )
        self._thread.start()
        self.url = f"http://{host}:{self._httpd.server_port}/metrics"
        log.info("%s: metrics on %s", what, self.url)

    def stats(self) -> dict[str, int]:
        """Connections open; refused over a cap; accept() failures survived; closed idle; closed slow."""
        httpd = self._httpd
        return httpd.guard_stats() if httpd is not None else {}

    def close(self) -> None:
        """Stop serving and end open connections. Idempotent."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.close_connections()
            httpd.server_close()
            self._thread.join(timeout=5)


class _Handler(WSGIRequestHandler):
    """One scrape per connection, timed by the server's limits; logs nothing per request."""

    server: "_HttpServer"

    def setup(self) -> None:
        self.timeout = self.server.limits.frame_timeout_s  # each receive and write (sendall: in total)
        super().setup()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.request_read(self.request)  # headers read: no longer a slowloris suspect
        return ok

    def log_message(self, format, *args) -> None:  # noqa: A002 - the stdlib's signature
        pass


class _HttpServer(GuardedServerMixIn, ThreadingMixIn, WSGIServer):
    """wsgiref's server with connection limits (GuardedServerMixIn) and the address family ``host`` needs."""

    request_queue_size = 128  # socketserver's 5 would drop scrapes under a burst before they are counted

    def __init__(self, host: str, port: int, limits: ConnLimits, what: str, config_prefix: str):
        self.address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self.guard(limits, what, config_prefix, _refusal, timed_reads=True)
        super().__init__((host, port), _Handler)


def _refusal(reason: str) -> bytes:
    """The HTTP answer of an over-limit scraper: 503 with the reason as text."""
    body = f"connection refused: {reason}\n".encode()
    return (
        b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    ) + body


class _Collector:
    def __init__(self, families):
        self._families = families

    def collect(self):
        yield from self._families()


# ---- series ------------------------------------------------------------------------------------------
def master_families(snap: MasterSnapshot) -> list:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    st = snap.status
    out = [
        GaugeMetricFamily(
            "kvplugins_master_leader",
            "1 if this master serves (always 1 without HA), 0 on an HA standby",
            value=0 if st is None else 1,
        )
    ] + _guard_families(snap.server)
    if st is None:
        return out + [_latency_family(snap)]
    for name, key, doc in (
        ("capacity_bytes", "bytes_total", "DRAM of all registered segments"),
        ("used_bytes", "bytes_used", "allocated bytes (objects, pending puts, zombies)"),
        ("objects", "objects", "objects in the table (pending included)"),
        ("pending_objects", "pending", "puts started, not committed"),
        ("zombie_ranges", "zombies", "removed objects whose space waits for a lease"),
    ):
        out.append(GaugeMetricFamily(f"kvplugins_master_{name}", doc, value=st.get(key, 0)))
    out.append(GaugeMetricFamily("kvplugins_master_segments", "registered segments", value=len(st["segments"])))
    out += _segment_families(st["segments"])
    for key in snap.counters:
        out.append(CounterMetricFamily(f"kvplugins_master_{key}", f"master counter {key}", value=st.get(key, 0)))
    out += _tier_families(st, set(snap.counters) | MASTER_KEYS, set(snap.tier_counters))
    out.append(_latency_family(snap))
    return out


def _guard_families(server: dict | None) -> list:
    """The raw endpoint's limits at work (master/rpc_server.py, issue #11)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if not server:
        return []
    errors = CounterMetricFamily(
        "kvplugins_master_internal_errors",
        "unexpected exceptions contained by the master's loop, by subsystem (op, connection, tick, sweep, ...)",
        labels=["subsystem"],
    )
    for name, n in sorted(server["internal_errors"].items()):
        errors.add_metric([name], n)
    return [
        errors,
        GaugeMetricFamily("kvplugins_master_connections", "raw RPC connections open", value=server["connections"]),
        CounterMetricFamily(
            "kvplugins_master_connections_refused",
            "raw RPC connections refused over max_connections / max_connections_per_peer",
            value=server["refused"],
        ),
        CounterMetricFamily(
            "kvplugins_master_accept_failures",
            "accept() failures (EMFILE, ENFILE, ...) survived by pausing",
            value=server["accept_failures"],
        ),
    ]


MASTER_KEYS = {"segments", "objects", "pending", "zombies", "bytes_used", "bytes_total"}


def _segment_families(segments: list) -> list:
    from prometheus_client.core import GaugeMetricFamily

    fams = {
        k: GaugeMetricFamily(f"kvplugins_segment_{name}", doc, labels=["segment", "host"])
        for k, name, doc in (
            ("size", "capacity_bytes", "segment size"),
            ("used", "used_bytes", "allocated bytes in the segment"),
            ("objects", "objects", "objects with a replica in the segment"),
            ("free_blocks", "free_blocks", "free-list blocks (fragmentation)"),
            ("largest_free", "largest_free_bytes", "largest free block"),
        )
    }
    age = GaugeMetricFamily(
        "kvplugins_segment_heartbeat_age_seconds", "time since the last heartbeat", labels=["segment", "host"]
    )
    for s in segments:
        labels = [s["name"], s.get("host_id", "")]
        for k, fam in fams.items():
            fam.add_metric(labels, s.get(k, 0))
        age.add_metric(labels, s.get("heartbeat_age_ms", 0) / 1000)
    return list(fams.values()) + [age]


def _tier_families(st: dict, known: set, counters: set) -> list:
    """Numbers the disk tier merged into ``status`` (Tiering.status()): ``counters`` as counters, else gauges."""
    return _numbers("kvplugins_tier_", {k: v for k, v in st.items() if k not in known}, "disk tier", counters)


def _numbers(prefix: str, items: dict, what: str, counters: set = frozenset()) -> list:
    """One series per numeric value: a counter if its key is in ``counters`` or names an event
    (TIER_COUNTER_WORDS), else a gauge."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    out = []
    for key, value in items.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = prefix + "".join(c if c.isalnum() else "_" for c in key).lower()
        if key in counters or any(w in key for w in TIER_COUNTER_WORDS):
            out.append(CounterMetricFamily(name.removesuffix("_total"), f"{what} counter {key}", value=value))
        else:
            out.append(GaugeMetricFamily(name, f"{what} {key}", value=value))
    return out


def _latency_family(snap: MasterSnapshot):
    from prometheus_client.core import HistogramMetricFamily

    fam = HistogramMetricFamily(
        "kvplugins_master_op_latency_seconds",
        "time the master spent dispatching one batch op (per RPC, not per key)",
        labels=["op"],
    )
    for op, h in sorted(snap.ops.items()):
        n = len(snap.bounds)
        cum, buckets = 0, []
        for bound, c in zip(snap.bounds, h[:n]):
            cum += c
            buckets.append((repr(bound), cum))
        buckets.append(("+Inf", cum + h[n]))
        fam.add_metric([op], buckets, sum_value=h[-1])
    return fam


def node_families(node, status: dict | None) -> list:
    """A node's series: its segment's capacity, and (if the master answered) usage, objects, heartbeat age;
    ``kvplugins_node_master_up`` says whether it did. Disk-tier numbers from the node's ``tier.stats()``
    (kvplugins/store/node/disk/worker.py) if it has one."""
    from prometheus_client.core import GaugeMetricFamily

    seg = node.segment
    labels = ["segment"]
    out = []

    def gauge(name, doc, value):
        fam = GaugeMetricFamily(f"kvplugins_node_{name}", doc, labels=labels)
        fam.add_metric([seg.name], value)
        out.append(fam)

    gauge("capacity_bytes", "DRAM this node contributes", seg.region.length)
    gauge("master_up", "1 if the master answered the last status query", 0 if status is None else 1)
    mine = next((s for s in (status or {}).get("segments", []) if s["name"] == seg.name), None)
    if mine is not None:
        gauge("used_bytes", "allocated bytes in this node's segment", mine["used"])
        gauge("objects", "objects with a replica in this node's segment", mine["objects"])
        gauge(
            "heartbeat_age_seconds", "age of this node's last heartbeat at the master", mine["heartbeat_age_ms"] / 1000
        )
    out += _disk_families(node)
    return out


def _disk_families(node) -> list:
    stats = getattr(getattr(node, "tier", None), "stats", None)
    if stats is None:
        return []
    return _numbers("kvplugins_node_disk_", {k.removeprefix("disk_"): v for k, v in stats().items()}, "node disk tier")


def serve_node(node, config) -> NodeMetrics | None:
    """Start a store node's endpoint if ``config.metrics_port >= 0`` (StoreNodeConfig); else None."""
    port = getattr(config, "metrics_port", -1)
    if port < 0:
        return None
    limits = config.metrics_limits() if hasattr(config, "metrics_limits") else None
    return NodeMetrics(node, node.master, config.rpc_timeout_ms).serve(
        getattr(config, "metrics_host", "127.0.0.1"), port, limits
    )
