"""Per-batch page counts and bandwidth for SGLang's storage metrics, plus the store client's counters.

``snapshot`` returns SGLang's ``StorageMetrics`` (prefetch_pgs, backup_pgs, prefetch_bandwidth,
backup_bandwidth in GB/s per batch; drained on each call, as SGLang's collector expects) with one extra
attribute ``kvplugins``: the StoreClient's hits, misses, bytes_put, bytes_got, put/get batch p50/p99 (µs) and
the page store's counters (saved, skipped, loaded, failed pages, store errors).
"""

from __future__ import annotations

import threading

MAX_SAMPLES = 4096  # per list between two get_stats calls (SGLang drains them; this bounds memory if it does not)


class Metrics:
    """enabled: SGLang's ``enable_storage_metrics``; when off, nothing is recorded per batch."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._lists = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}

    def _add(self, kind: str, pages: int, page_bytes: int, seconds: float) -> None:
        if pages <= 0 or not self.enabled:
            return
        with self._lock:
            if len(self._lists[f"{kind}_pgs"]) >= MAX_SAMPLES:
                return
            self._lists[f"{kind}_pgs"].append(pages)
            self._lists[f"{kind}_bandwidth"].append(pages * page_bytes / max(seconds, 1e-9) / 1e9)

    def prefetch(self, pages: int, page_bytes: int, seconds: float) -> None:
        """Record one batch_get_v1: ``pages`` loaded of ``page_bytes`` bytes each in ``seconds``."""
        self._add("prefetch", pages, page_bytes, seconds)

    def backup(self, pages: int, page_bytes: int, seconds: float) -> None:
        """Record one batch_set_v1."""
        self._add("backup", pages, page_bytes, seconds)

    def snapshot(self, client_stats: dict, page_stats: dict):
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            lists = {k: v for k, v in self._lists.items()}
            self._lists = {k: [] for k in self._lists}
        out = StorageMetrics(**lists)
        out.kvplugins = {**client_stats, **page_stats}
        return out
