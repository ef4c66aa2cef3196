"""Worker half: maps the engine's KV tensors once, then loads/saves whole pages straight into/from them."""
from __future__ import annotations

import logging

from kvplugins.errors import ConfigError
from kvplugins.layout import PageLayout, PageStore, Plane, planes_of
from kvplugins.vllm_kv_connector import engine
from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
from kvplugins.vllm_kv_connector.metadata import KVPluginsConnectorMetadata

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, vllm_config, kv_cache_config, cfg: VllmConnectorConfig):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        self.cfg, self.kv_cache_config = cfg, kv_cache_config
        self.keyspace = engine.keyspace(vllm_config, kv_cache_config, cfg, get_tensor_model_parallel_rank())
        self.pages: PageStore | None = None
        self.load_errors: set[int] = set()

    def register(self, kv_caches: dict) -> None:
        """kv_caches: layer name -> KV tensor, block dim first (CPU: [num_blocks, kv_heads, block_size,
        head_size*2]). Raises ConfigError if the pages it describes differ from the key space's page bytes."""
        names = engine.attention_group(self.kv_cache_config).layer_names
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ConfigError(f"KVPluginsConnector: no KV tensor for layers {missing}")
        num_blocks = self.kv_cache_config.num_blocks
        layout = PageLayout([p for n in names for p in _engine_blocks(planes_of(kv_caches[n]), num_blocks)])
        if layout.page_bytes != self.keyspace.page_bytes:
            raise ConfigError(f"KVPluginsConnector: KV tensors give {layout.page_bytes} B pages, the KV cache spec "
                              f"{self.keyspace.page_bytes} B; unsupported KV layout")
        self.pages = PageStore(self.cfg.client_factory(), self.keyspace, layout, retry_ms=self.cfg.retry_ms,
                               retry_on_load=True)  # the scheduler found these pages just now
        self.pages.connect()
        log.info("kvplugins: %d layers, %d blocks, %d B pages, namespace %s", len(names), layout.num_blocks,
                 layout.page_bytes, self.keyspace.namespace)

    def load(self, meta: KVPluginsConnectorMetadata) -> None:
        if meta.loads.block_ids and self.pages is not None:
            self.load_errors.update(self.pages.load(meta.loads.block_ids, meta.loads.hashes))

    def save(self, meta: KVPluginsConnectorMetadata) -> None:
        if meta.saves.block_ids and self.pages is not None:
            self.pages.save(meta.saves.block_ids, meta.saves.hashes)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors


def _engine_blocks(planes: list[Plane], num_blocks: int) -> list[Plane]:
    """Planes in units of engine blocks: a kernel may split one engine block into k adjacent kernel blocks."""
    out = []
    for p in planes:
        k, rem = divmod(p.num_blocks, num_blocks)
        if rem or k < 1 or (k > 1 and p.block_stride != p.block_bytes):
            raise ConfigError(f"KV tensor with {p.num_blocks} blocks does not map onto {num_blocks} engine blocks")
        out.append(Plane(p.base, p.block_stride * k, p.block_bytes * k, num_blocks) if k > 1 else p)
    return out
