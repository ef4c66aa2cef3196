"""What the scheduler half ships to the worker half each step."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class PageBatch:
    """Pages to move: page ``hashes[i]`` (vLLM block hash bytes) <-> engine block ``block_ids[i]``."""
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)

    def add(self, block_ids, hashes) -> None:
        self.block_ids.extend(block_ids)
        self.hashes.extend(hashes)


@dataclass
class KVPluginsConnectorMetadata(KVConnectorMetadata):
    """loads: pages to scatter into blocks before this step's forward; saves: full pages to store after it."""
    loads: PageBatch = field(default_factory=PageBatch)
    saves: PageBatch = field(default_factory=PageBatch)
