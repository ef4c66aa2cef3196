"""KVPluginsConnector: the KVConnectorBase_V1 subclass vLLM instantiates in its scheduler and its workers.

Each hook only translates: the scheduler role delegates to SchedulerSide, the worker role to WorkerSide.
Once the KV cache is registered each worker's ``get_handshake_metadata`` tells the scheduler (through vLLM's
``set_xfer_handshake_metadata_pp_aware``, keyed by (PP rank, TP rank)) the key spaces its part of a page lives
in, and a P/D producer's export.
Large hits load asynchronously (``get_num_new_matched_tokens`` -> ``(n, True)``; completion through
``get_finished``), small ones before the step's forward; saves are submitted in ``wait_for_save`` and run in
the background, ``handle_preemptions`` (called before every forward) fences the saves of requests whose
blocks were freed and, where it may, starts the step's asynchronous loads and P/D acks (vLLM would start
them after the forward). Telemetry: ``get_kv_connector_stats`` / ``build_kv_connector_stats`` /
``build_prom_metrics`` (stats.py). KV events (events.py): ``get_kv_connector_kv_cache_events`` (worker) ->
``update_connector_output`` -> ``take_events`` (scheduler). Source followed: vLLM 0.32 KVConnectorBase_V1
(vllm/distributed/kv_transfer/kv_connector/v1/base.py) and the model runner's connector mixin.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
from kvplugins.vllm_kv_connector.events import KVPluginsKVEvents
from kvplugins.vllm_kv_connector.metadata import KVPluginsConnectorMetadata
from kvplugins.vllm_kv_connector.stats import KVPluginsPromMetrics, KVPluginsStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["KVPluginsConnector", "KVPluginsConnectorMetadata"]


class KVPluginsConnector(KVConnectorBase_V1, SupportsHMA):
    """Shares full KV pages between vLLM instances through the kvplugins store (see package docstring).
    Hybrid models (vLLM's hybrid memory allocator): every full-attention and sliding-window KV cache group is
    keyed apart and saved and loaded; a hit counts only where every group holds what it needs (engine.Group)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = VllmConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvplugins.vllm_kv_connector.scheduler import SchedulerSide
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, cfg)
        else:
            from kvplugins.vllm_kv_connector.worker import WorkerSide
            self._worker = WorkerSide(vllm_config, kv_cache_config, cfg)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # -- scheduler side ---------------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.prefix_cache = kv_cache_manager

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        if connector_output.invalid_block_ids:
            self._scheduler.load_failed(set(connector_output.invalid_block_ids))
        if connector_output.failed_recving:
            self._scheduler.loads_failed(set(connector_output.failed_recving))
        if isinstance(connector_output.kv_cache_events, KVPluginsKVEvents):
            self._scheduler.add_events(connector_output.kv_cache_events)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids[0])

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
                                             ) -> None:
        self._scheduler.set_workers(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler.set_workers({(0, tp): meta for tp, meta in metadata.items()})

    # -- worker side ------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        self._worker.fence(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker.load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)  # layer_chunks > 1: this layer's chunk; else a no-op (loads are whole)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # whole pages (all layers) are saved in wait_for_save

    def wait_for_save(self):
        self._worker.save(self._get_connector_metadata())

    def get_kv_connector_kv_cache_events(self) -> "KVPluginsKVEvents | None":
        return self._worker.events.take() if self._worker.events is not None else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self._worker.finished(finished_req_ids)
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), self._worker.take_failed_recving())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
        elif self._scheduler is not None and self._scheduler.pages is not None:
            self._scheduler.pages.close()

    # -- telemetry --------------------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return (self._scheduler or self._worker).stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPluginsStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type["PromMetric"], type["PromMetricT"]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return KVPluginsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
