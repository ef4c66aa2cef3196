"""Issue #11's seven reproductions against a real ``kvplugins master`` on loopback, as regression tests: no
message or burst of connections kills the master, stalls it, or grows its memory without bound; an established
client keeps being served (bounded p99) and gets the right bytes afterwards.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import statistics
import threading
import time

import msgpack
import pytest
from helpers.auth import authenticated
from helpers.cluster import master_process, store_cluster

from kvplugins.errors import MasterUnreachable, StoreError
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.wire.protocol import HEADER, INVALID, VERSION
from kvplugins.store.client.rpc import RawRpcClient
from kvplugins.store.client.connect import control_client

N_DESCRIBED = 2500  # segments in one describe: a ~50 kB request, a ~650 kB reply
P99_BOUND_S = 0.5  # another client's op latency while an attack runs (normally ~0.1 ms here)


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def connect(address: str, authenticate: bool = True) -> socket.socket:
    """A raw connection to the master, authenticated as admin (or not: a flood of bare connections)."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    return authenticated(s) if authenticate else s


def roundtrip_ok(client: StoreClient, tag: str) -> None:
    """A normal client's put and get of fresh bytes."""
    data = (tag.encode() * 700)[:4096]
    client.put(f"fresh/{tag}", data)
    assert client.get(f"fresh/{tag}") == data


class Prober:
    """Times ``exists`` from a normal client in a thread while an attack runs (the other clients' view)."""

    def __init__(self, address: str):
        self.rpc = RawRpcClient(address, 5000)
        self.lat: list[float] = []
        self.spans: list[tuple[float, float]] = []  # (start, end) of each probe, perf_counter s
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                self.rpc.call("exists", ["probe"])
                t1 = time.perf_counter()
                self.lat.append(t1 - t0)
                self.spans.append((t0, t1))
            except StoreError as e:
                self.errors.append(str(e))
            time.sleep(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)
        self.rpc.close()

    def check(self) -> None:
        assert not self.errors, self.errors[:3]
        assert len(self.lat) >= 20, f"only {len(self.lat)} probes ran"
        p99 = statistics.quantiles(self.lat, n=100)[98]
        assert p99 < P99_BOUND_S, f"p99 {p99 * 1000:.0f} ms of another client during the attack"


@pytest.fixture(scope="module")
def cluster():
    flags = {"frame_timeout_ms": 1000, "partial_frames_budget": "96MiB", "reply_buffer": "1MiB"}
    with (
        store_cluster(nodes=1, segment_size="16MiB", master_flags=flags) as c,
        StoreClient(ClientConfig(master=c.master)) as client,
    ):
        c.client = client
        yield c
        assert c.master_proc.alive(), c.master_proc.log_tail()


@pytest.mark.parametrize("plane", ["raw", "zmq"])
def test_crafted_checksum_is_refused_and_never_stored(cluster, plane):
    rpc = RawRpcClient(cluster.master, 3000) if plane == "raw" else control_client(cluster.master, 3000)
    key = f"crafted/{plane}"
    try:
        [(code, _)] = rpc.call("put_start", [[key, 64]])
        assert code == 0
        nested: list = []
        for _ in range(600):
            nested = [nested]
        with pytest.raises(StoreError, match=r"put_commit: opts: .* at `\$.xxh3\[0\]"):
            rpc.call("put_commit", [key], {"xxh3": [nested]})
        rpc.call("put_commit", [key], {"xxh3": [12345]})
        [(code, value)] = rpc.call("get", [key])
        assert code == 0 and value[3] == 12345  # the valid checksum, not the crafted one
    finally:
        rpc.close()
    assert cluster.master_proc.alive()
    roundtrip_ok(cluster.client, f"checksum-{plane}")


def test_string_size_in_tier_register_is_refused_whole(cluster):
    rpc = control_client(cluster.master, 3000, "node")
    seg = cluster.nodes[0].address
    try:
        with pytest.raises(StoreError, match=r"tier_register: entries: Expected `int`, got `str` - at `\$\[0\]"):
            rpc.call("tier_register", [[seg, "127.0.0.1:1", 1 << 20, [["k", "12", 7]], "d"]])
        time.sleep(0.3)  # several ticks: tiering.lose_node used to crash here
        assert rpc.call("status")["disk_objects"] == 0
    finally:
        rpc.close()
    assert cluster.master_proc.alive()
    roundtrip_ok(cluster.client, "tier")


def test_catastrophic_regex_runs_in_linear_time(cluster):
    cluster.client.put("a" * 30, b"x" * 64)
    rpc = RawRpcClient(cluster.master, 5000, "admin")
    try:
        t0 = time.monotonic()
        assert rpc.call("remove_by_regex", ["^(a+)+$"], {"force": True}) == [0, 1]
        assert time.monotonic() - t0 < 2.0  # backtracking re took ~71 s on this key
        code, reason = rpc.call("remove_by_regex", [r"(a)\1"])
        assert code == INVALID and "does not compile under RE2" in reason
    finally:
        rpc.close()


def test_huge_batch_is_refused_naming_the_limit(cluster):
    rpc = RawRpcClient(cluster.master, 10000)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=r"max_batch is 65536"):
            rpc.call("get", [f"k{i}" for i in range(1_000_000)])
        assert time.monotonic() - t0 < 5.0
    finally:
        rpc.close()
    roundtrip_ok(cluster.client, "batch")


def test_unread_replies_are_bounded_and_the_peer_dropped(cluster):
    pid = cluster.master_proc.popen.pid
    base = rss_mb(pid)
    seg = cluster.nodes[0].address  # describe: each ~30-byte entry answers a ~200-byte descriptor
    body = msgpack.packb([VERSION, 1, "describe", [seg] * 2000, {}])
    req = HEADER.pack(len(body)) + body
    with Prober(cluster.master) as probe, contextlib.closing(connect(cluster.master)) as s:
        s.setblocking(False)
        stream = memoryview(req * ((24 << 20) // len(req)))
        sent, peak, blocked = 0, base, None
        while sent < len(stream) and (blocked is None or time.monotonic() - blocked < 1.5):
            try:
                sent += s.send(stream[sent : sent + (1 << 20)])
                blocked = None
            except BlockingIOError:  # the master stopped reading us: backpressure
                blocked = blocked or time.monotonic()
                time.sleep(0.01)
            except (ConnectionResetError, BrokenPipeError):
                break  # already dropped for not reading its replies
            peak = max(peak, rss_mb(pid))
        assert sent < len(stream)  # the master stopped reading a peer that reads nothing
        time.sleep(2.0)  # frame_timeout 1 s with no reply read: dropped
        peak = max(peak, rss_mb(pid))
        s.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            while s.recv(1 << 20):  # what was sent before the drop, then EOF (or reset)
                pass
    probe.check()
    assert peak - base < 64, f"RSS grew {peak - base:.0f} MB (was +215 MB before the limit)"
    roundtrip_ok(cluster.client, "unread")


def test_partial_frames_share_a_budget(cluster):
    pid = cluster.master_proc.popen.pid
    base = rss_mb(pid)
    chunk = b"\0" * (1 << 20)
    socks, peak = [], base
    with Prober(cluster.master) as probe:
        for _ in range(6):
            s = connect(cluster.master)
            socks.append(s)
            s.sendall(HEADER.pack(60 << 20))
            with contextlib.suppress(OSError):
                for _ in range(40):
                    s.sendall(chunk)
            peak = max(peak, rss_mb(pid))
        time.sleep(1.5)  # slowloris: each partial frame times out after 1 s
        peak = max(peak, rss_mb(pid))
        for s in socks:
            s.close()
    probe.check()
    assert peak - base < 200, f"RSS grew {peak - base:.0f} MB (budget 96 MiB; was +373 MB before)"
    time.sleep(0.5)
    assert rss_mb(pid) - base < 120
    roundtrip_ok(cluster.client, "partial")


def test_idle_and_slow_connections_are_closed(cluster):
    with contextlib.closing(connect(cluster.master)) as slow:
        slow.sendall(HEADER.pack(100) + b"\x95")  # half a frame, then nothing
        slow.settimeout(5)
        t0 = time.monotonic()
        assert slow.recv(10) == b""  # closed by the master
        assert time.monotonic() - t0 < 3


def test_fd_exhaustion_keeps_serving_established_clients():
    with master_process() as m:
        pid = m.popen.pid
        est = RawRpcClient(m.address, 3000)
        assert est.call("exists", ["x"]) == [False]
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (128, 128))
        flood = []
        try:
            for _ in range(300):
                with contextlib.suppress(OSError):
                    flood.append(connect(m.address, authenticate=False))
            time.sleep(0.3)
            for _ in range(20):  # the established client is served throughout
                assert est.call("exists", ["x"]) == [False]
        finally:
            for s in flood:
                s.close()
        time.sleep(1.0)
        fresh = RawRpcClient(m.address, 3000)  # recovered: new connections are accepted again
        assert fresh.call("exists", ["x"]) == [False]
        fresh.close()
        est.close()
        assert m.alive(), m.log_tail()
        assert "accept failed" in m.log_tail(20000)


def test_connection_caps_refuse_with_the_reason():
    from test_metrics import endpoint_url, value, wait_for

    with master_process(max_connections_per_peer=3, metrics_port=0) as m:
        held = [RawRpcClient(m.address, 3000) for _ in range(3)]
        for c in held:
            c.call("exists", ["x"])
        extra = RawRpcClient(m.address, 3000)
        with pytest.raises(MasterUnreachable, match=r"per-peer limit \(master.max_connections_per_peer=3\)"):
            extra.call("exists", ["x"])
        held[0].close()
        time.sleep(0.3)
        assert extra.call("exists", ["x"]) == [False]  # room again
        seen = wait_for(endpoint_url(m), lambda s: value(s, "kvplugins_master_connections") == 3)
        assert value(seen, "kvplugins_master_connections_refused_total") == 1
        assert value(seen, "kvplugins_master_accept_failures_total") == 0
        for c in held[1:] + [extra]:
            c.close()


def test_a_bug_in_one_subsystem_is_contained():
    """The schemas leave no known input that crashes a subsystem, so a bug is injected (the only mock here):
    the tick and one op raise; the loop counts them and goes on serving."""
    from kvplugins.store.config import MasterConfig
    from kvplugins.store.master.rpc_server import RpcServer

    server = RpcServer(MasterConfig(tick_ms=20))

    def broken(*args):
        raise RuntimeError("injected bug")

    server.service.tick = broken
    server.service._ops["exists_prefix"] = broken
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    rpc = RawRpcClient(server.address, 3000)
    try:
        time.sleep(0.2)
        with pytest.raises(StoreError, match="exists_prefix: internal error RuntimeError"):
            rpc.call("exists_prefix", ["a"])
        assert rpc.call("exists", ["a"]) == [False]  # same connection, still served
        stats = server.guard_stats()
        assert stats["internal_errors"]["tick"] >= 3 and stats["internal_errors"]["op"] == 1
    finally:
        rpc.close()
        server.stop()
        thread.join(5)
    assert not thread.is_alive()


def test_admin_scan_yields_to_other_clients():
    """remove_all over 200k objects runs in slices: another client's ops complete while it runs."""
    with store_cluster(nodes=1, segment_size="32MiB") as c:
        rpc = RawRpcClient(c.master, 30000, "admin")
        n = 200_000
        for i in range(0, n, 50_000):  # metadata only: no bytes are needed to be scanned
            keys = [f"scan/{j}" for j in range(i, i + 50_000)]
            assert all(code == 0 for code, _ in rpc.call("put_start", [[k, 1] for k in keys]))
            rpc.call("put_commit", keys)
        done = []

        def scan():
            result = rpc.call("remove_all", [], {"force": True})
            done.append((time.perf_counter(), result))

        scanner = threading.Thread(target=scan)
        with Prober(c.master) as probe:
            time.sleep(0.2)
            t0 = time.perf_counter()
            scanner.start()
            scanner.join(60)
        t1, result = done[0]
        assert result == [0, n]
        inside = [x for x in probe.spans if x[0] >= t0 and x[1] <= t1]  # probes entirely inside the scan
        assert inside, f"no other op completed during the {(t1 - t0) * 1000:.0f} ms scan"
        probe.check()
        rpc.close()


def test_a_large_reply_to_one_frame_arrives_whole_and_the_connection_goes_on(cluster):
    """One small request (one recv, the master's one-frame path in rpc_server.py) whose reply (~650 kB) a peer with a
    16 kB receive window reads late: it arrives whole and alone, and the connection serves the next request. (What
    the master's socket does not take at once goes the buffered way; on loopback the kernel takes up to
    tcp_wmem's 4 MB, more than a one-recv request can ask for, so that branch is not forced here.)"""
    seg = cluster.nodes[0].address
    body = msgpack.packb([VERSION, 1, "describe", [seg] * N_DESCRIBED, {}])
    host, port = cluster.master.rsplit(":", 1)
    with contextlib.closing(socket.socket()) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # before connect: a small window
        s.settimeout(5)
        s.connect((host, int(port)))
        authenticated(s)
        s.sendall(HEADER.pack(len(body)) + body)
        time.sleep(0.2)  # the master's send fills the socket, the rest waits for this peer to read

        def reply() -> list:
            buf = b""
            while len(buf) < HEADER.size or len(buf) < HEADER.size + HEADER.unpack_from(buf)[0]:
                chunk = s.recv(1 << 16)
                assert chunk, "the master closed the connection"
                buf += chunk
            assert len(buf) == HEADER.size + HEADER.unpack_from(buf)[0]  # nothing after the one reply
            return msgpack.unpackb(buf[HEADER.size :])

        version, rid, ok, payload = reply()
        assert (version, rid, ok, len(payload)) == (VERSION, 1, True, N_DESCRIBED)
        assert len({msgpack.packb(p) for p in payload}) == 1  # every entry the same segment's descriptor
        body = msgpack.packb([VERSION, 2, "exists", ["nothing/here"], {}])
        s.sendall(HEADER.pack(len(body)) + body)
        assert reply()[:3] == [VERSION, 2, True]
