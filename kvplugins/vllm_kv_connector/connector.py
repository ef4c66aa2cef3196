"""KVPluginsConnector: the KVConnectorBase_V1 subclass vLLM instantiates in its scheduler and its workers.

Each hook only translates: the scheduler role delegates to SchedulerSide, the worker role to WorkerSide.
Loads are synchronous (the pages land before the step's forward; async loading is issue #4); saves run in
wait_for_save, after the forward wrote the step's KV. Source followed: vLLM 0.32 KVConnectorBase_V1
(vllm/distributed/kv_transfer/kv_connector/v1/base.py).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
from kvplugins.vllm_kv_connector.metadata import KVPluginsConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["KVPluginsConnector", "KVPluginsConnectorMetadata"]


class KVPluginsConnector(KVConnectorBase_V1):
    """Shares full KV pages between vLLM instances through the kvplugins store (see package docstring)."""

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
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request)
        return False, None

    # -- worker side ------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker.load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are complete when start_load_kv returns

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # whole pages (all layers) are saved in wait_for_save

    def wait_for_save(self):
        self._worker.save(self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self):
        side = self._scheduler or self._worker
        if side is not None and side.pages is not None:
            side.pages.close()
