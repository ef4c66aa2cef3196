"""Page I/O between an engine's paged KV memory and the store, engine-independent.

PageStore turns (block ids, block hashes) into store calls on whole pages, zero-copy: loads scatter each
stored object straight into the engine's blocks (``batch_get_into``), saves gather straight from them
(``batch_put_from``). It survives an unreachable store through its ResilientClient (connection.py, one per
process, shared with ``share=``): the first failure (a raised store error, or a batch whose transfers failed) is
logged once, every call then answers "miss"/"not saved" without touching the network until ``retry_ms`` has
passed, then it retries.
Never raises a store error into the engine; a load that did not land reports its block ids as failed.
Thread-safe: several engine threads (e.g. a load thread and a save thread) may share one PageStore.

Source followed: the Mooncake store's batch_get_into/batch_put_from zero-copy contract (docs/store.md).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from kvplugins.errors import KVPluginsError, StoreError
from kvplugins.layout.connection import ResilientClient, failure
from kvplugins.layout.keys import KeySpace
from kvplugins.layout.spans import PageLayout, zero_spans
from kvplugins.layout.staged import StagedPages

log = logging.getLogger(__name__)


class PageStore:
    """Pages of one layer group in one process.

    client_factory: () -> a StoreClient (called lazily, again after a failure once retry_ms passed).
    keyspace: this process's key space (its TP rank). layout: the engine's KV memory (None on a process that
    only looks up, e.g. a scheduler). required: the key spaces whose pages must all be stored for a hit (default:
    ``keyspace`` alone): a scheduler's are every TP rank's and every PP stage's (``require`` replaces them once
    the workers told theirs).
    staged: move the pages through host bounce slots (layout/staged.py) instead of straight from ``layout``'s
    memory: required for KV in device memory; the slots are what is registered with the client. Its ``mark()``
    (on the engine thread) gives the ``after`` of load/save.
    share: another PageStore whose client and connection state this one uses (one client for a hybrid model's
    KV cache groups); its memory is registered with that client too. Only the first PageStore closes the client.
    """

    def __init__(
        self,
        client_factory: Callable[[], Any],
        keyspace: KeySpace,
        layout: PageLayout | None = None,
        required: Sequence[KeySpace] = (),
        retry_ms: float = 5000,
        staged: StagedPages | None = None,
        share: "PageStore | None" = None,
    ):
        self.keyspace, self.layout, self.staged = keyspace, layout, staged
        self._spaces = list(required) or [keyspace]
        # one client per process: a PageStore made with share= uses (and never closes) the other's
        self.conn = share.conn if share is not None else ResilientClient(client_factory, retry_ms, keyspace.namespace)
        self._owns_conn = share is None
        self._stats = {
            "lookups": 0,
            "hit_pages": 0,
            "loaded_pages": 0,
            "failed_pages": 0,
            "saved_pages": 0,
            "skipped_pages": 0,
            "store_errors": 0,
        }
        self.conn.attach(self._register)

    @property
    def stats(self) -> dict[str, int]:
        """Counters of this PageStore's pages; ``store_errors``: failures of the client it uses (shared)."""
        self._stats["store_errors"] = self.conn.errors
        return self._stats

    # -- connection -------------------------------------------------------------------------------------------
    def connect(self) -> bool:
        """Connect now (and register the KV memory) rather than on first use; False if the store is down."""
        return self._connected() is not None

    def _connected(self) -> Any:
        return self.conn.get()

    def _register(self, client) -> None:
        """Register this PageStore's KV memory (or its bounce slots) with ``client``."""
        if self.layout is not None:
            for addr, nbytes in (self.staged or self.layout).regions():
                client.register_buffer(addr, length=nbytes)

    def _failed(self, err: Exception) -> None:
        self.conn.failed(err)

    def require(self, spaces: Sequence[KeySpace]) -> None:
        """From now on a page is a hit only when it is stored in every one of ``spaces`` (non-empty)."""
        if not spaces:
            raise KVPluginsError("require() needs at least one key space")
        self._spaces = list(spaces)

    # -- operations -------------------------------------------------------------------------------------------
    def stored_prefix(self, hashes: Sequence[bytes]) -> int:
        """Number of leading pages of ``hashes`` stored in every required key space, in one RPC; 0 if the store
        is down."""
        if len(self._spaces) > 1:
            mask = self.stored_mask(hashes)
            n = mask.index(False) if False in mask else len(mask)
        else:
            client = self._connected() if hashes else None
            if client is None:
                return 0
            self.stats["lookups"] += 1
            try:
                n = client.batch_exists_prefix(self._spaces[0].keys(hashes))
            except KVPluginsError as e:
                self._failed(e)
                return 0
        self.stats["hit_pages"] += n
        return n

    def stored_mask(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether each page of ``hashes`` is stored in every required key space, in one RPC; all False if the store is
        down (a sliding-window group's hit needs only the pages of its window, not a prefix)."""
        n = len(hashes)
        client = self._connected() if n else None
        if client is None:
            return [False] * n
        self.stats["lookups"] += 1
        try:
            present = client.batch_exists([k for s in self._spaces for k in s.keys(hashes)])
        except KVPluginsError as e:
            self._failed(e)
            return [False] * n
        return [all(present[r * n + i] for r in range(len(self._spaces))) for i in range(n)]

    def load(
        self, block_ids: Sequence[int], hashes: Sequence[bytes], after: Any = None, found_at: float | None = None
    ) -> list[int]:
        """Scatter page ``hashes[i]`` into block ``block_ids[i]``; returns the block ids that did not load
        (store down, evicted, size mismatch, checksum mismatch). A failed block is left zeroed (read in place)
        or untouched (staged): never bytes that failed their checksum, since an engine may reuse a freed block
        partly filled, and masked garbage such as inf turns attention into NaN (vLLM zeroes reused blocks only
        for Mamba or mixed precision). ``after``: staged only, the engine's mark (see StagedPages).
        ``found_at`` (time.monotonic() s): a lookup found these pages by then; inside the back-off the load
        reconnects at once unless the store failed after it (ResilientClient.get), so a failed load costs a
        recompute only when the store is really down."""
        return load_pages([self], block_ids, hashes, after, found_at)

    def save(self, block_ids: Sequence[int], hashes: Sequence[bytes], after: Any = None) -> int:
        """Store the pages not stored yet (one exists RPC, then one batch put); returns pages written.
        ``after``: staged only, the engine's mark taken after the forward that wrote the blocks."""
        return self.save_held(block_ids, hashes, after)[0]

    def save_held(self, block_ids: Sequence[int], hashes: Sequence[bytes], after: Any = None) -> tuple[int, list]:
        """save(), also returning per page whether the store holds it afterwards (already there, or written
        now): (pages written, [bool per page]); all False if the store is down."""
        return save_pages([self], block_ids, hashes, after)

    def track(self, names: Sequence[str]) -> None:
        """Called with the store keys this PageStore just wrote (save_pages); nothing here. A subclass that
        must take back exactly its own pages later (layout/hicache.py) remembers them."""

    def _layout(self) -> PageLayout:
        if self.layout is None:
            raise KVPluginsError("this PageStore has no KV memory layout; pass layout= to load or save pages")
        return self.layout

    def close(self) -> None:
        if self._owns_conn:
            self.conn.close()
        if self.staged is not None:
            self.staged.close()


# -- pages stored as one object per part (per KV head: layout/shards.py), one batch RPC for all parts ----------
def load_pages(
    parts: Sequence[PageStore],
    block_ids: Sequence[int],
    hashes: Sequence[bytes],
    after: Any = None,
    found_at: float | None = None,
) -> list[int]:
    """PageStore.load for pages stored as one object per part (each part: its key space and its layout of the
    blocks; all parts share one client, ``share=``): one ``batch_get_into`` for every part's objects. A block
    fails when any of its objects fails; only the failed objects' bytes are zeroed. Staged parts move part by
    part (their bounce slots are per part). Statistics count pages, on ``parts[0]``."""
    if not block_ids:
        return []
    head = parts[0]
    if head.staged is not None and len(parts) > 1:
        failed = {b for part in parts for b in load_pages([part], block_ids, hashes, after, found_at)}
        return [b for b in block_ids if b in failed]
    spans = [sp for part in parts for sp in part._layout().spans_for(block_ids)] if head.staged is None else None
    client = head.conn.get(found_at)
    keys = [k for part in parts for k in part.keyspace.keys(hashes)]
    if client is None:  # the store is down: every block fails, and is zeroed like any failed block
        errors: list = [StoreError("the store is unavailable (backing off after a failure)")] * len(keys)
    else:
        try:
            errors = (
                client.batch_get_into(keys, spans)
                if spans is not None
                else head.staged.load(client, keys, block_ids, after)
            )
        except KVPluginsError as e:
            head._failed(e)
            errors, client = [e] * len(keys), None  # down now: logged once by _failed
        except BaseException:  # unexpected: what landed is unknown, so no block keeps it
            if spans is not None:
                zero_spans([sp for block in spans for sp in block])
            raise
    if spans is not None:  # bytes read in place that failed (store down, checksum, size): none stay
        zero_spans([sp for block, err in zip(spans, errors) if err is not None for sp in block])
    n = len(block_ids)
    failed = [b for i, b in enumerate(block_ids) if any(errors[j * n + i] is not None for j in range(len(parts)))]
    down = failure(errors) if client is not None else None
    if down is not None:  # a node that stopped answering: back off rather than wait for it request by request
        head._failed(down)
    elif failed and client is not None:  # a store that is down was logged once, by _failed
        log.warning(
            "kvplugins: %d of %d pages failed to load: %s", len(failed), n, next(e for e in errors if e is not None)
        )
    head.stats["loaded_pages"] += n - len(failed)
    head.stats["failed_pages"] += len(failed)
    return failed


def save_pages(
    parts: Sequence[PageStore], block_ids: Sequence[int], hashes: Sequence[bytes], after: Any = None
) -> tuple[int, list]:
    """PageStore.save_held for pages stored as one object per part (see load_pages): one ``batch_exists`` and
    one ``batch_put_from`` for every part's missing objects. A page is held when every part's object is; it
    counts as written when it is held and this call wrote some of its objects. Staged parts move part by part."""
    n = len(block_ids)
    if not n:
        return 0, []
    head = parts[0]
    if head.staged is not None and len(parts) > 1:
        results = [save_pages([part], block_ids, hashes, after) for part in parts]
        held = [all(r[1][i] for r in results) for i in range(n)]
        return max(r[0] for r in results), held
    layouts = [part._layout() for part in parts]
    client = head._connected()
    if client is None:
        return 0, [False] * n
    keys = [k for part in parts for k in part.keyspace.keys(hashes)]
    try:
        present = list(client.batch_exists(keys))
        todo = [x for x, p in enumerate(present) if not p]  # object x: part x // n, page x % n
        head.stats["skipped_pages"] += sum(all(present[j * n + i] for j in range(len(parts))) for i in range(n))
        if not todo:
            return 0, [True] * n
        ids = [block_ids[x % n] for x in todo]
        todo_keys = [keys[x] for x in todo]
        errors = (
            client.batch_put_from(todo_keys, _spans_of(layouts, todo, n, ids))
            if head.staged is None
            else head.staged.save(client, todo_keys, ids, after)
        )
    except KVPluginsError as e:
        head._failed(e)
        return 0, [False] * n
    bad = [e for e in errors if e is not None]
    down = failure(bad)
    if down is not None:  # as in load_pages: the next request does not wait for that node again
        head._failed(down)
    elif bad:
        log.warning("kvplugins: %d of %d page saves failed: %s", len(bad), len(todo), bad[0])
    for x, err in zip(todo, errors):
        present[x] = err is None
    head.track([todo_keys[j] for j, err in enumerate(errors) if err is None])
    held = [all(present[j * n + i] for j in range(len(parts))) for i in range(n)]
    wrote = {x % n for x in todo}
    written = sum(1 for i in wrote if held[i])
    head.stats["saved_pages"] += written
    return written, held


def _spans_of(layouts: Sequence[Any], todo: Sequence[int], n: int, ids: Sequence[int]) -> list:
    """The spans of objects ``todo`` (object x: part x // n's layout, block ``ids[i]`` for the i-th), one
    ``spans_for`` call per part."""
    by_part: dict[int, list[int]] = {}
    for i, x in enumerate(todo):
        by_part.setdefault(x // n, []).append(i)
    out: list = [None] * len(todo)
    for j, idx in by_part.items():
        for i, sp in zip(idx, layouts[j].spans_for([ids[i] for i in idx])):
            out[i] = sp
    return out
