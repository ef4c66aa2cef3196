"""Pages stored per KV head, so that an engine at any TP size reads what one at another TP size wrote.

A TP rank holds some of the model's ``heads`` KV heads (``rank_heads``). Stored per head, page ``p``'s head
``h`` is one object in the key space "TP rank ``h`` of TP size ``heads``": what an engine at TP = heads would
write for its rank ``h``, so an engine at TP 1, 2, 4... (any size that divides the heads, or that the heads
divide) loads the heads it holds, and P/D works between prefill and decode at different TP sizes through the
store. The bytes moved per rank are the same as whole-page objects; a rank moves ``heads / tp`` objects per
page instead of one, all of a batch's in one RPC. A head's part of a block must be one run of bytes
(head-major layouts: vLLM CPU's LBHNC, HND); other layouts keep one object per TP rank
(``spans.head_planes``).

Source followed: Mooncake's TP-sharded store layouts in vLLM 0.32 (``mooncake/store``: LBHNC objects per store
TP shard) and SGLang HiCache's ``page_head`` layout; here the shard is always one KV head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvplugins.errors import ConfigError
from kvplugins.layout.pages import PageStore, load_pages, save_pages


@dataclass(frozen=True)
class RankHeads:
    """The KV heads TP rank ``rank`` holds: ``first .. first + count - 1`` of ``heads``. ``writes``: False for a
    replica of a head another rank writes (TP > heads: vLLM gives each head to ``tp / heads`` ranks)."""

    first: int
    count: int
    heads: int
    writes: bool = True


def rank_heads(tp_rank: int, tp_size: int, heads: int) -> RankHeads:
    """Which of ``heads`` KV heads TP rank ``tp_rank`` of ``tp_size`` holds, as vLLM's QKVParallelLinear splits
    them (contiguous ranges; replicated when tp_size > heads). Raises ConfigError when neither divides the
    other."""
    if heads <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"TP rank {tp_rank} of {tp_size} with {heads} KV heads")
    if heads % tp_size == 0:
        per = heads // tp_size
        return RankHeads(tp_rank * per, per, heads)
    if tp_size % heads == 0:
        replicas = tp_size // heads
        return RankHeads(tp_rank // replicas, 1, heads, writes=tp_rank % replicas == 0)
    raise ConfigError(f"{heads} KV heads over TP size {tp_size}: neither divides the other")


class HeadShards:
    """One layer group's pages on one TP rank, one PageStore per KV head it holds (``parts``, in head order,
    sharing one client). The calls of PageStore a worker makes: a page loads only when each of its heads
    loads; it is held only when every head is stored; a replica rank (``writes`` False) saves nothing.
    ``layout``: the rank's whole pages (every head), for what reads blocks whole (P/D direct)."""

    def __init__(self, parts: Sequence[PageStore], layout: Any, writes: bool = True):
        if not parts:
            raise ConfigError("HeadShards needs at least one head's PageStore")
        self.parts, self.layout, self.writes = list(parts), layout, writes
        self.keyspace, self.staged = self.parts[0].keyspace, self.parts[0].staged

    def connect(self) -> bool:
        return self.parts[0].connect()

    def load(
        self, block_ids: Sequence[int], hashes: Sequence[bytes], after: Any = None, found_at: float | None = None
    ) -> list[int]:
        """Every head's objects into the blocks in one batch RPC; returns the block ids any head failed
        (pages.load_pages; ``found_at`` as PageStore.load)."""
        return load_pages(self.parts, block_ids, hashes, after, found_at)

    def save_held(self, block_ids: Sequence[int], hashes: Sequence[bytes], after: Any = None) -> tuple[int, list]:
        """Every head's missing objects in one batch RPC (pages.save_pages): (pages written, whether each page
        is held for every head afterwards). A replica rank writes nothing and reports the pages held: the rank
        that writes its head reports the truth (a hit needs every head's object anyway)."""
        if not self.writes:
            return 0, [True] * len(block_ids)
        return save_pages(self.parts, block_ids, hashes, after)

    def close(self) -> None:
        for part in self.parts:
            part.close()
