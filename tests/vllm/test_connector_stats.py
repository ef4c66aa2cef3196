"""The connector's telemetry as vLLM drives it (no engine): stats objects built, aggregated, reduced, rebuilt by
name through MultiConnector, and recorded into real prometheus_client metrics; the plugin entry point."""

from __future__ import annotations

import types

import pytest
from helpers.installed import require

require("vllm", "bash ci/install.sh")
pytestmark = pytest.mark.vllm


def test_stats_aggregate_reduce_and_empty():
    from kvplugins.vllm_kv_connector.stats import KVPluginsStats, StatsRecorder

    rec = StatsRecorder()
    assert rec.take() is None  # nothing happened: vLLM gets None, not an empty object
    rec.add(loaded_blocks=3, loaded_bytes=300)
    rec.observe("load_seconds", 0.002)
    a = rec.take()
    assert rec.take() is None  # taking resets
    b = KVPluginsStats(data={"loaded_blocks": 1, "load_seconds": [0.004], "hit_blocks": 2})
    total = a.aggregate(b).reduce()
    assert total["loaded_blocks"] == 4 and total["loaded_bytes"] == 300 and total["hit_blocks"] == 2
    assert total["avg_load_ms"] == pytest.approx(3.0)
    assert KVPluginsStats().is_empty() and not a.is_empty()


def test_entry_point_registers_by_name_and_multiconnector_rebuilds_stats():
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvplugins.vllm_kv_connector import KVPluginsConnector
    from kvplugins.vllm_kv_connector.stats import KVPluginsStats

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvplugins"]
    ep.load()()
    ep.load()()  # loading twice is harmless
    assert KVConnectorFactory.get_connector_class_by_name("KVPluginsConnector") is KVPluginsConnector
    stats = MultiConnector.build_kv_connector_stats(data={"KVPluginsConnector": {"saved_blocks": 5}})
    inner = stats.data["KVPluginsConnector"]
    assert isinstance(inner, KVPluginsStats) and inner.reduce()["saved_blocks"] == 5


def test_prom_metrics_record_counters_and_latencies():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric  # noqa: F401 (API present)

    from kvplugins.vllm_kv_connector import KVPluginsConnector

    reg = CollectorRegistry()

    def bind(cls):
        return lambda **kw: cls(registry=reg, **kw)

    types_ = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}
    cfg = types.SimpleNamespace(kv_transfer_config=None)
    prom = KVPluginsConnector.build_prom_metrics(cfg, types_, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"loaded_blocks": 7, "loaded_bytes": 7000, "load_seconds": [0.003, 0.2]}, engine_idx=0)
    text = generate_latest(reg).decode()
    assert 'vllm:kvplugins_loaded_blocks_total{engine="0",model_name="m"} 7.0' in text
    assert 'vllm:kvplugins_load_seconds_count{engine="0",model_name="m"} 2.0' in text
