"""KV event messages, as vLLM 0.32 frames them (vllm/distributed/kv_events.py: ``KVEventBatch`` of ``BlockStored``
/ ``BlockRemoved`` / ``AllBlocksCleared``; SGLang 0.5.23 sends the same shapes): what the master publishes about
the shared pool (store/master/events.py) and what ``kvplugins router`` reads from the engines and the master
(router/feeds.py).

Wire: msgpack of the batch as an array ``[ts, [event, ...], data_parallel_rank?]``; each event a map tagged by
its class name in ``type``. A block hash is the engine's: bytes (vLLM's sha256 prefix hashes, the master's object
keys as UTF-8) or an int (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, SGLang). Fields a reader does not
know are ignored, so a newer engine's extra fields decode; vLLM requires ``lora_id``, ``medium`` and
``lora_name`` (None when not set: the master sends them), SGLang leaves out those that are None (UNSET here, and
never sent when UNSET). ``reason`` is ours (the master's; vLLM's decoder
ignores it).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVEvent"]

BlockHash = bytes | int


class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Blocks now held by ``medium`` ("GPU": the engine's cache; "CPU": the store's DRAM pool, "STORAGE": its
    disk tier). ``token_ids``: the tokens of every block in ``block_hashes``, ``block_size`` (tokens) each;
    ``parent_block_hash``: the block before the first one (None: the first block of a prompt)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None | UnsetType = UNSET
    medium: str | None | UnsetType = UNSET
    lora_name: str | None | UnsetType = UNSET
    extra_keys: list[object] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    reason: str = "stored"


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Blocks ``medium`` no longer holds."""

    block_hashes: list[BlockHash]
    medium: str | None | UnsetType = UNSET
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    reason: str = "removed"


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The engine dropped every block of its cache (vLLM: a prefix cache reset)."""

    medium: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: wall-clock ``ts`` (s), its events in order, the engine's data-parallel rank."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
