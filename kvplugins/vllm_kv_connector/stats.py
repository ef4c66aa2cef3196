"""Connector telemetry for vLLM: ``KVPluginsStats`` (a KVConnectorStats) and ``KVPluginsPromMetrics``.

Each process half (scheduler: lookups; worker: loads/saves) counts into a ``StatsRecorder``; vLLM pulls a
snapshot every step through ``get_kv_connector_stats``, ships it to the front-end as ``to_dict()`` (plain
ints and lists, msgpack-safe), rebuilds it with ``build_kv_connector_stats`` and feeds it to the logger and to
``build_prom_metrics``' object, so ``/metrics`` shows ``vllm:kvplugins_*``. Latencies are in seconds.
Source followed: vLLM 0.32 kv_connector/v1/metrics.py (KVConnectorStats, KVConnectorPromMetrics).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

COUNTERS = {  # data key -> Prometheus help
    "hit_blocks": "pages found in the kvplugins store at lookup",
    "miss_blocks": "pages looked up in the kvplugins store and not found",
    "loaded_blocks": "pages loaded from the kvplugins store into KV blocks",
    "loaded_bytes": "bytes loaded from the kvplugins store",
    "async_blocks": "pages whose load ran in the background (asynchronous hits)",
    "direct_blocks": "pages read straight from a prefill instance's KV memory (P/D direct path)",
    "failed_blocks": "pages that failed to load (reported to vLLM for recompute or failure)",
    "layer_waits": "layer chunks an attention layer waited for (layer-wise loads, layer_chunks > 1)",
    "saved_blocks": "pages saved to the kvplugins store",
    "saved_bytes": "bytes saved to the kvplugins store",
    "replica_skips": "pages a TP rank did not save because another rank saves the same bytes (MLA's latent KV: "
    "TP rank 0; a KV head held by several ranks when TP > KV heads: the first of them)",
}
LATENCIES = {  # data key -> Prometheus help (one observation per batch, seconds)
    "load_seconds": "latency of one kvplugins load batch (s)",
    "save_seconds": "latency of one kvplugins save batch (s)",
    "pd_handoff_seconds": "P/D prefill side: from a request's end until decode acked its direct read, or its "
    "store saves landed; the request's blocks are held meanwhile (s)",
}
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def _empty() -> dict[str, Any]:
    return {**{k: 0 for k in COUNTERS}, **{k: [] for k in LATENCIES}}


@dataclass
class KVPluginsStats(KVConnectorStats):
    """Counters (``COUNTERS``, ints) and latency samples (``LATENCIES``, lists of seconds) of one interval."""

    def __post_init__(self):
        self.data = {**_empty(), **(self.data or {})}

    def reset(self):
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> "KVPluginsStats":
        for k in COUNTERS:
            self.data[k] += int(other.data.get(k, 0))
        for k in LATENCIES:
            self.data[k] = list(self.data[k]) + list(other.data.get(k, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data[k] for k in COUNTERS}
        for k in LATENCIES:
            xs = self.data[k]
            out[f"avg_{k.removesuffix('_seconds')}_ms"] = round(1000 * sum(xs) / len(xs), 3) if xs else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in COUNTERS) and not any(self.data[k] for k in LATENCIES)


class StatsRecorder:
    """Thread-safe accumulator (the worker's transfer threads and the engine thread both count)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._data = _empty()

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self._data[k] += int(v)

    def observe(self, key: str, seconds: float) -> None:
        with self._lock:
            self._data[key].append(float(seconds))

    def take(self) -> KVPluginsStats | None:
        """The interval's stats (then reset), or None when nothing happened."""
        with self._lock:
            data, self._data = self._data, _empty()
        stats = KVPluginsStats(data=data)
        return None if stats.is_empty() else stats


class KVPluginsPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvplugins_<counter>`` counters and ``vllm:kvplugins_{load,save,pd_handoff}_seconds`` histograms,
    per engine."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        metric_types: dict[type["PromMetric"], type["PromMetricT"]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            k: self._per_engine(self._counter_cls(name=f"vllm:kvplugins_{k}", documentation=doc, labelnames=labelnames))
            for k, doc in COUNTERS.items()
        }
        self._histograms = {
            k: self._per_engine(
                self._histogram_cls(
                    name=f"vllm:kvplugins_{k}", documentation=doc, labelnames=labelnames, buckets=BUCKETS
                )
            )
            for k, doc in LATENCIES.items()
        }

    def _per_engine(self, metric) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, by_engine in self._counters.items():
            if transfer_stats_data.get(k):
                by_engine[engine_idx].inc(transfer_stats_data[k])
        for k, by_engine in self._histograms.items():
            for x in transfer_stats_data.get(k, ()):
                by_engine[engine_idx].observe(x)
