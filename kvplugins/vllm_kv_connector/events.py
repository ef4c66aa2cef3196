"""KV events of the connector (issue #15): ``BlockStored`` for every page the store holds after a save, in vLLM's
own event types, so vLLM publishes them on its KV event stream (``kv_events_config``) beside its prefix cache's.

Flow, per vLLM 0.32's connector API: a worker records an event for each page of a save batch found stored
afterwards (saved now, or already there) -> ``get_kv_connector_kv_cache_events`` hands them to vLLM, which
merges every TP worker's (``add_events`` + ``increment_workers``) -> the scheduler half's
``update_connector_output`` keeps them -> ``take_events`` yields each event once every worker reported it (a page
is stored for the engine only when every TP rank's part is). Events carry the page's vLLM block hash, its parent
hash, its token ids, the block size, medium ``CPU`` (the store's DRAM pool) and, as vLLM's own events do, its
KV cache group (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``): a hybrid model's
groups each report their pages (a sliding-window group only the pages it saved; a state group the pages whose
state it holds). Loads add no event: the blocks
they fill are the engine's own cache, which vLLM reports itself. Source followed: vLLM 0.32
``MooncakeStoreKVEvents`` (kv_connector/v1/mooncake/store/connector.py) and ``kv_events.KVConnectorKVEvents``.
"""

from __future__ import annotations

import threading
from collections import Counter

from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored, KVCacheEvent, KVConnectorKVEvents


class KVPluginsKVEvents(KVConnectorKVEvents):
    """Events of ``num_workers`` workers, counted: an event is complete once every worker added it."""

    def __init__(self, events: list | None = None, num_workers: int = 1):
        self._count: Counter = Counter(events or ())
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._count.update(events)

    def aggregate(self) -> "KVPluginsKVEvents":
        done = self.take_complete()
        self._count, self._workers = Counter(done), 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._count.elements())

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._count.clear()
        self._workers = 1

    def take_complete(self) -> list[KVCacheEvent]:
        """Remove and return the events every worker reported."""
        done = [e for e, n in self._count.items() if n >= self._workers]
        for e in done:
            del self._count[e]
        return done

    def merge(self, other: "KVPluginsKVEvents") -> "KVPluginsKVEvents":
        self.add_events(other.get_all_events())
        return self


class EventLog:
    """A worker's recorded events (the save thread records, the engine thread takes). Thread-safe."""

    def __init__(self, block_size: int):
        self._block_size = block_size
        self._lock = threading.Lock()
        self._events: list = []

    def stored(self, hashes, parents, token_ids, spec=None, group: int | None = None) -> None:
        """The pages ``hashes`` (with their parent hashes and token ids) of KV cache group ``group`` (its vLLM
        ``spec``) are in the store."""
        kind = window = None
        if spec is not None:
            from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

            kind, window = get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)
        new = [
            BlockStored(
                block_hashes=[h],
                parent_block_hash=p,
                token_ids=list(t),
                block_size=self._block_size,
                lora_id=None,
                medium=MEDIUM_CPU,
                lora_name=None,
                group_idx=group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
            )
            for h, p, t in zip(hashes, parents, token_ids)
        ]
        with self._lock:
            self._events += new

    def take(self) -> KVPluginsKVEvents | None:
        with self._lock:
            events, self._events = self._events, []
        return KVPluginsKVEvents(events) if events else None
