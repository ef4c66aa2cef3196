"""Prometheus endpoints: scrape a real master, a real store node and a real `kvplugins up` over HTTP and check
that the series move with the operations done through a StoreClient; the snapshot the HTTP thread reads is a
private copy; disk-tier numbers from Tiering.status() become kvplugins_tier_* series."""

import re
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.cluster import store_cluster, up_process
from kvplugins.errors import KeyNotFound
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.config import MasterConfig
from kvplugins.store.master.service import MasterService
from kvplugins.store.metrics import MasterMetrics, MasterSnapshot, OpTimer, master_families

URL = re.compile(r"metrics on (http://[\d.]+:\d+/metrics)")


def endpoint_url(proc, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        urls = URL.findall(proc.log_tail(100_000))
        if urls:
            return urls[-1]
        time.sleep(0.05)
    raise AssertionError(f"no metrics URL logged:\n{proc.log_tail()}")


def scrape(url: str) -> dict:
    """{(sample name, frozenset(labels)): value}"""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def wait_for(url: str, cond, timeout_s: float = 10.0) -> dict:
    """Scrape until ``cond(samples)`` holds (the master publishes once per tick, a node caches 1 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        try:
            if cond(samples):
                return samples
        except KeyError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"condition never held; last scrape: {sorted(samples)[:40]}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def metered(tmp_path_factory):
    disk = tmp_path_factory.mktemp("disk")
    with store_cluster(
        nodes=1,
        segment_size="4MiB",
        master_flags={"metrics_port": 0},
        node_flags={"metrics_port": 0, "disk_dir": disk, "disk_capacity": "8MiB"},
    ) as c:
        yield c, endpoint_url(c.master_proc), endpoint_url(c.nodes[0])


COUNTED = (
    "kvplugins_master_hits_total",
    "kvplugins_master_misses_total",
    "kvplugins_master_objects",
    "kvplugins_master_removes_total",
    "kvplugins_master_commits_total",
)


def test_master_series_move_with_operations(metered):
    c, url, _ = metered
    assert url.startswith("http://127.0.0.1:")  # default bind: loopback only
    before = wait_for(url, lambda s: value(s, "kvplugins_master_segments") == 1)
    while True:  # settled: what earlier tests did is published
        time.sleep(0.3)
        again = scrape(url)
        if all(value(again, n) == value(before, n) for n in COUNTED):
            break
        before = again
    assert value(before, "kvplugins_master_capacity_bytes") == 4 << 20
    with StoreClient(ClientConfig(master=c.master)) as client:
        for i in range(3):
            client.put(f"m/{i}", bytes([i]) * 1000)
        assert client.get("m/0") == bytes(1000) and client.get("m/1") == b"\x01" * 1000
        with pytest.raises(KeyNotFound):
            client.get("m/absent")
        client.remove("m/2")

    def moved(samples, name, **labels):  # what this test did: other tests share the cluster
        return value(samples, name, **labels) - before.get((name, frozenset(labels.items())), 0.0)

    seg = c.nodes[0].address
    after = wait_for(
        url, lambda s: moved(s, "kvplugins_master_removes_total") >= 1 and moved(s, "kvplugins_master_hits_total") >= 2
    )
    assert moved(after, "kvplugins_master_hits_total") == 2
    assert moved(after, "kvplugins_master_misses_total") == 1
    assert moved(after, "kvplugins_master_commits_total") >= 3
    assert moved(after, "kvplugins_master_objects") == 2
    assert moved(after, "kvplugins_master_used_bytes") >= 2 * 1000
    assert moved(after, "kvplugins_segment_objects", segment=seg, host=_host(after, seg)) == 2
    assert moved(after, "kvplugins_master_op_latency_seconds_count", op="put_start") >= 3
    assert value(after, "kvplugins_master_op_latency_seconds_sum", op="get") > 0
    assert moved(after, "kvplugins_master_evictions_total") == 0
    assert value(after, "kvplugins_process_resident_memory_bytes") > 0
    assert moved(after, "kvplugins_tier_offloads_total") == 0  # the disk tier's counters
    assert value(after, "kvplugins_tier_disk_capacity") == 8 << 20


def _host(samples: dict, seg: str) -> str:
    return next(
        dict(labels)["host"]
        for name, labels in samples
        if name == "kvplugins_segment_objects" and dict(labels)["segment"] == seg
    )


def test_node_series_follow_its_segment(metered):
    c, _, node_url = metered
    seg = c.nodes[0].address
    assert node_url.startswith("http://127.0.0.1:")
    with StoreClient(ClientConfig(master=c.master)) as client:
        client.put("n/0", b"z" * 5000)
        objects = len([k for k in ("m/0", "m/1", "n/0") if client.exists(k)])
    s = wait_for(node_url, lambda s: value(s, "kvplugins_node_objects", segment=seg) == objects)
    assert value(s, "kvplugins_node_capacity_bytes", segment=seg) == 4 << 20
    assert value(s, "kvplugins_node_master_up", segment=seg) == 1
    assert value(s, "kvplugins_node_used_bytes", segment=seg) >= 5000
    assert 0 <= value(s, "kvplugins_node_heartbeat_age_seconds", segment=seg) < 3
    assert value(s, "kvplugins_node_disk_capacity") == 8 << 20  # the node's disk tier


def test_up_serves_master_and_node_series_on_one_endpoint():
    with up_process(segment_size="2MiB", metrics_port=0) as up:
        url = endpoint_url(up)
        with StoreClient(ClientConfig(master=up.address)) as client:
            client.put("u/0", b"u" * 100)
        s = wait_for(
            url,
            lambda s: (
                value(s, "kvplugins_master_objects") == 1
                and any(name == "kvplugins_node_objects" and v == 1 for (name, _), v in s.items())
            ),
        )
        assert value(s, "kvplugins_master_capacity_bytes") == 2 << 20
        assert any(name == "kvplugins_node_capacity_bytes" and v == 2 << 20 for (name, _), v in s.items())


def test_metrics_off_by_default():
    with store_cluster(nodes=1, segment_size="1MiB") as c:
        time.sleep(0.3)
        assert "metrics on" not in c.master_proc.log_tail(100_000) + c.nodes[0].log_tail(100_000)


class _Server:
    """RpcServer's part that MasterMetrics reads (no sockets)."""

    def __init__(self, service):
        self.service = service

    def guard_stats(self) -> dict:
        return {"connections": 2, "refused": 1, "accept_failures": 0, "internal_errors": {"tick": 3}}


def test_snapshot_is_a_private_copy_and_counts_ops():
    svc = MasterService(MasterConfig())
    metrics = MasterMetrics(_Server(svc), MasterConfig(metrics_port=-1))
    assert metrics.endpoint is None and metrics.snapshot is None  # off: nothing published
    metrics.timer.record("get", 3e-6)
    metrics.timer.record("get", 2.0)  # beyond the last bound: +Inf only
    metrics.endpoint = object()  # publish as if serving
    metrics.publish()
    snap = metrics.snapshot
    svc.counters["hits"] += 5
    svc.counters["misses"] += 1
    assert snap.status["hits"] == 0 and snap.status["misses"] == 0  # the live counters moved, the copy not
    metrics.timer.record("get", 1e-3)
    assert sum(snap.ops["get"][:-1]) == 2  # count frozen at publish
    fams = {f.name: f for f in master_families(snap)}
    [tick_errors] = fams["kvplugins_master_internal_errors"].samples
    assert tick_errors.labels == {"subsystem": "tick"} and tick_errors.value == 3
    fam = fams["kvplugins_master_op_latency_seconds"]
    buckets = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    assert buckets["1e-05"] == 1 and buckets["0.1"] == 1 and buckets["+Inf"] == 2


def test_tier_numbers_become_series():
    status = {
        "segments": [],
        "objects": 0,
        "pending": 0,
        "zombies": 0,
        "bytes_used": 0,
        "bytes_total": 0,
        "hits": 4,
        "offloads": 7,
        "disk_bytes_used": 123,
        "disk_enabled": True,
        "disk_dir": "/x",
    }
    snap = MasterSnapshot(status, ("hits",), {}, OpTimer().bounds)
    names = {s.name: s.value for f in master_families(snap) for s in f.samples}
    assert names["kvplugins_tier_offloads_total"] == 7
    assert names["kvplugins_tier_disk_bytes_used"] == 123
    assert names["kvplugins_master_hits_total"] == 4
    assert not any("disk_enabled" in n or "disk_dir" in n for n in names)


def test_ha_standby_reports_not_leader_and_keeps_the_loop_alive():
    from kvplugins.store.master.ha.leader import LeaderGuard

    standby = LeaderGuard(MasterConfig(), journal=None)  # no elector: a standby that refuses every op
    with pytest.raises(ValueError):
        standby.handle("status", [], {})
    metrics = MasterMetrics(_Server(standby), MasterConfig(metrics_port=-1))
    metrics.endpoint = object()
    metrics.publish()  # must not raise into the master's loop
    names = {s.name: s.value for f in master_families(metrics.snapshot) for s in f.samples}
    assert names["kvplugins_master_leader"] == 0 and "kvplugins_master_objects" not in names
    metrics._server = _Server(MasterService(MasterConfig()))
    metrics.publish()
    names = {s.name: s.value for f in master_families(metrics.snapshot) for s in f.samples}
    assert names["kvplugins_master_leader"] == 1 and names["kvplugins_master_objects"] == 0
