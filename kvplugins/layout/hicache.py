"""HiCache-style page I/O (engine-independent): pages named by string keys and located by buffer metadata.

SGLang's HiCache (and any engine that describes a batch of pages as a flat ``(pointers, sizes)`` list, e.g. a
host pool's ``get_page_buffer_meta``) needs three things the vLLM-oriented pieces of this package do not give:

* ``page_spans``: split the flat list into one span list per page (every page has the same number of
  entries), adjacent entries merged — the page object is their concatenation, in the engine's order;
* ``MetaLayout``: a PageStore layout whose spans come from such a metadata callback instead of planes;
* ``KeyedPageStore``: a PageStore for string keys with per-page results (``save_each``), safe to call from
  several threads (SGLang's prefetch and backup threads share one backend).

The key namespace is ``keys.KeySpace`` (one hash over everything that shapes the bytes); ``hicache_keyspace``
fills it in for a HiCache pool. Source followed: SGLang 0.5.23 ``HiCacheStorage`` v1 interface and
``HostKVCache.get_page_buffer_meta`` (pointers in page order, the same count per page).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from kvplugins.errors import ConfigError, KVPluginsError
from kvplugins.layout.keys import KeySpace
from kvplugins.layout.pages import PageStore, save_pages
from kvplugins.layout.spans import PageLayout, Plane, Span

Meta = tuple[Sequence[int], Sequence[int]]  # (addresses, byte sizes) of every piece of a batch of pages


def page_spans(ptrs: Sequence[int], sizes: Sequence[int], num_pages: int) -> list[list[Span]]:
    """Split a batch's flat ``(ptrs, sizes)`` (bytes) into ``num_pages`` span lists, adjacent runs merged.
    Raises ConfigError if the lists differ in length or do not divide evenly into pages."""
    if len(ptrs) != len(sizes) or num_pages <= 0 or len(ptrs) % num_pages:
        raise ConfigError(
            f"buffer metadata of {len(ptrs)} pointers / {len(sizes)} sizes does not split into "
            f"{num_pages} pages; the host pool's page size and the key count disagree"
        )
    import numpy as np

    per = len(ptrs) // num_pages
    p = np.asarray(ptrs, dtype=np.uint64).reshape(num_pages, per)
    n = np.asarray(sizes, dtype=np.uint64).reshape(num_pages, per)
    if not (p[:, :-1] + n[:, :-1] == p[:, 1:]).any():  # the usual case: no piece continues the previous
        return [list(zip(a, b)) for a, b in zip(p.tolist(), n.tolist())]
    return [_merged(a, b) for a, b in zip(p.tolist(), n.tolist())]


def _merged(ptrs: Sequence[int], sizes: Sequence[int]) -> list[Span]:
    spans: list[list[int]] = []
    for a, n in zip(ptrs, sizes):
        if spans and spans[-1][0] + spans[-1][1] == a:
            spans[-1][1] += n
        else:
            spans.append([a, n])
    return [(a, n) for a, n in spans]


def covering_ranges(ranges: Sequence[Span]) -> list[Span]:
    """The disjoint (address, nbytes) ranges covering ``ranges`` (overlapping/adjacent merged): what to register."""
    return PageLayout([Plane(a, 0, n, 1) for a, n in ranges if n > 0]).regions() if ranges else []


class MetaLayout:
    """A PageStore layout whose page spans come from ``meta(block_ids) -> (ptrs, sizes)``.

    block ids are the engine's page numbers (e.g. host index // page size). buffers: (address, nbytes) of
    the memory every span lies in (registered with the transfer engine on connect)."""

    def __init__(self, meta: Callable[[Sequence[int]], Meta], buffers: Sequence[Span]):
        self._meta = meta
        self._regions = covering_ranges(buffers)
        if not self._regions:
            raise ConfigError("a HiCache layout needs at least one host buffer (the host pool has no KV memory)")

    def spans_for(self, block_ids: Sequence[int]) -> list[list[Span]]:
        if not block_ids:
            return []
        ptrs, sizes = self._meta(block_ids)
        return page_spans(ptrs, sizes, len(block_ids))

    def regions(self) -> list[Span]:
        return list(self._regions)


def hicache_keyspace(
    *,
    model: str,
    kv_dtype: str,
    page_size: int,
    page_bytes: int,
    pool: str,
    layout: str,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    shared_across_tp: bool,
    io_format: str,
    extra: str = "",
) -> KeySpace:
    """The key space of one HiCache pool shard. pool: "mha" / "mla"; layout: the host layout (its bytes
    order differs); io_format: "v1" (buffer-metadata order) or "flat" (the legacy flat page tensor).
    shared_across_tp: every TP rank holds the same bytes (MLA), so the TP rank is left out of the names."""
    rank, size = (0, 1) if shared_across_tp else (tp_rank, tp_size)
    group = f"sglang-hicache:{pool}:{layout}:{io_format}:pp{pp_rank}/{pp_size}"
    return KeySpace(
        model=model,
        kv_dtype=kv_dtype,
        block_size=page_size,
        layer_group=group,
        tp_rank=rank,
        tp_size=size,
        page_bytes=page_bytes,
        extra=extra,
    )


def key_bytes(keys: Sequence[str]) -> list[bytes]:
    """Engine keys (any strings) as the byte hashes KeySpace.keys names (UTF-8: injective, so no collisions)."""
    return [k.encode() for k in keys]


MAX_TRACKED = 1 << 20  # keys remembered for remove_saved (beyond this, older saves are not removed)


class KeyedPageStore(PageStore):
    """PageStore for string keys with per-page results, ``call`` for other store operations under the same
    outage handling (layout/connection.py), and a record of the keys it stored so ``remove_saved`` can take back
    exactly this process's pages from a shared pool."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._saved: set[str] = set()
        self._saved_lock = threading.Lock()

    def load_each(self, block_ids: Sequence[int], keys: Sequence[str]) -> list[bool]:
        """Scatter each stored page into its block; True where the bytes landed (False: miss, store down)."""
        failed = set(self.load(block_ids, key_bytes(keys)))
        return [b not in failed for b in block_ids]

    def save_each(self, block_ids: Sequence[int], keys: Sequence[str]) -> list[bool]:
        """Store pages not stored yet (one exists RPC, one batch put: pages.save_pages); True where the page is
        stored now. Never raises a store error: an unreachable store gives all False (logged once)."""
        return save_pages([self], block_ids, key_bytes(keys))[1]

    def stored_prefix_in(self, space: KeySpace, keys: Sequence[str]) -> int:
        """Leading ``keys`` stored under ``space``, one RPC; 0 if the store is down."""
        if not keys:
            return 0
        self.stats["lookups"] += 1
        n = self.call(lambda c: c.batch_exists_prefix(space.keys(key_bytes(keys))), 0)
        self.stats["hit_pages"] += n
        return n

    def call(self, fn: Callable[[Any], Any], default: Any) -> Any:
        """``fn(client)``, or ``default`` when the store is unreachable or ``fn`` raises a store error
        (logged once; the store is retried after retry_ms)."""
        client = self._connected()
        if client is None:
            return default
        try:
            return fn(client)
        except KVPluginsError as e:
            self._failed(e)
            return default

    def track(self, names: Sequence[str]) -> None:
        """Remember store keys this process wrote (for remove_saved), up to MAX_TRACKED."""
        with self._saved_lock:
            if len(self._saved) + len(names) <= MAX_TRACKED:
                self._saved.update(names)

    def remove_saved(self) -> int:
        """Remove every page this process stored (and still remembers); returns pages removed."""
        with self._saved_lock:
            names, self._saved = list(self._saved), set()
        errors = self.call(lambda c: c.batch_remove(names), None) if names else []
        return 0 if errors is None else sum(e is None for e in errors)

    def client_if_connected(self) -> Any:
        """The StoreClient if connected now (never connects), else None."""
        return self.conn.current
