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
from typing import TYPE_CHECKING, Iterable

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

from kvplugins.errors import KVPluginsError
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

    from kvplugins.vllm_kv_connector.scheduler import SchedulerSide
    from kvplugins.vllm_kv_connector.worker import WorkerSide

log = logging.getLogger(__name__)

__all__ = ["KVPluginsConnector", "KVPluginsConnectorMetadata"]


def log_through_vllm() -> None:
    """kvplugins' log records (INFO and up) go where vLLM's go, in its format, where the process configured no
    logging of its own (no handler on the root or ``kvplugins`` logger): an operator reads the connector's lines
    (its layout at start, a store that stopped answering) in the engine's log. (They showed before only because
    importing pyverbs called logging.basicConfig.)"""
    ours, vllm_log = logging.getLogger("kvplugins"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not vllm_log.handlers:
        return
    for handler in vllm_log.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


class KVPluginsConnector(KVConnectorBase_V1, SupportsHMA):
    """Shares full KV pages between vLLM instances through the kvplugins store (see package docstring).
    Hybrid models (vLLM's hybrid memory allocator): every full-attention and sliding-window KV cache group is
    keyed apart and saved and loaded; a hit counts only where every group holds what it needs (engine.Group)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_through_vllm()
        cfg = VllmConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvplugins.vllm_kv_connector.scheduler import SchedulerSide

            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, cfg)
        else:
            from kvplugins.vllm_kv_connector.worker import WorkerSide

            self._worker = WorkerSide(vllm_config, kv_cache_config, cfg)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    @property
    def _sched(self) -> "SchedulerSide":
        if self._scheduler is None:
            raise KVPluginsError("vLLM called a scheduler hook on the connector's worker role")
        return self._scheduler

    @property
    def _work(self) -> "WorkerSide":
        if self._worker is None:
            raise KVPluginsError("vLLM called a worker hook on the connector's scheduler role")
        return self._worker

    def _meta(self) -> KVPluginsConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVPluginsConnectorMetadata):
            raise KVPluginsError(
                f"connector metadata is a {type(meta).__name__}, not this connector's (was it "
                "built by another connector?)"
            )
        return meta

    # -- scheduler side ---------------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.prefix_cache = kv_cache_manager

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._sched.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if connector_output.invalid_block_ids:
            self._sched.load_failed(set(connector_output.invalid_block_ids))
        if connector_output.failed_recving:
            self._sched.loads_failed(set(connector_output.failed_recving))
        if isinstance(connector_output.kv_cache_events, KVPluginsKVEvents):
            self._sched.add_events(connector_output.kv_cache_events)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, object] | None]:
        return self._sched.finished(request, block_ids)

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, object] | None]:
        return self._sched.finished(request, block_ids[0])

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched.set_workers(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._sched.set_workers({(0, tp): meta for tp, meta in metadata.items()})

    # -- worker side ------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(kv_connector_metadata, KVPluginsConnectorMetadata):
            raise KVPluginsError(f"handle_preemptions got {type(kv_connector_metadata).__name__} metadata")
        self._work.fence(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: object) -> None:
        self._work.load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work.wait_layer(layer_name)  # layer_chunks > 1: this layer's chunk; else a no-op (loads are whole)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: object
    ) -> None:
        return  # whole pages (all layers) are saved in wait_for_save

    def wait_for_save(self) -> None:
        self._work.save(self._meta())

    def get_kv_connector_kv_cache_events(self) -> "KVPluginsKVEvents | None":
        events = self._work.events
        return events.take() if events is not None else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work.handshake()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work.finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self._work.finished(finished_req_ids)
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), self._work.take_failed_recving())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        elif self._scheduler is not None and self._scheduler.pages is not None:
            self._scheduler.pages.close()

    # -- telemetry --------------------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler if self._scheduler is not None else self._work
        return side.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, object] | None = None) -> KVConnectorStats | None:
        return KVPluginsStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[type["PromMetric"], type["PromMetricT"]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVPluginsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
