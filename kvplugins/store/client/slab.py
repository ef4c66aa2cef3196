"""The client's half of one-round-trip puts: space reserved from the master (a slab, store/master/slabs.py),
filled front to back. ``SlabSpace.place`` gives a batch its offsets (reserving a new slab, one extra round trip,
only when the current one is missing, too full or too close to expiry); the client writes the bytes there and
sends one ``put`` RPC, whose reply makes the objects visible to every client.

A slab is written only while more than ``margin_s`` (the client's transfer + RPC timeouts) of its lease is
left, so a write never lands after the master freed the space. One batch at a time uses the slab (a lock the
caller try-acquires; a concurrent put takes put_start + put_commit instead).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvplugins.errors import MasterUnreachable, StoreError
from kvplugins.store.wire import protocol
from kvplugins.transfer.spans import SMALL

log = logging.getLogger(__name__)
RETRY_S = 1.0  # after a refused reserve (store full), put_start for this long before asking again
NO_SLABS_S = 60.0  # after "this pool offers no slabs" (its segments are too small)


@dataclass
class Slab:
    id: int
    segment: str
    region_id: int
    front: int  # next free offset
    end: int
    align: int
    ttl_s: float  # the lease a reserve or put gives it
    expires: float  # monotonic s, conservative: measured from before the RPC that set it


class SlabSpace:
    """``slab_bytes`` of reserved space at a time, through ``rpc`` (a master RPC client)."""

    def __init__(self, rpc, slab_bytes: int, margin_s: float):
        self.rpc, self.slab_bytes, self.margin_s = rpc, slab_bytes, margin_s
        self.lock = threading.Lock()
        self._slab: Slab | None = None
        self._stale: list[int] = []  # slabs given up here, released with the next reserve
        self._retry_at = 0.0
        self._disabled = False

    def place(self, sizes: list[int]) -> tuple[Slab, list[int] | np.ndarray] | None:
        """Offsets (slab_offsets) for objects of ``sizes`` bytes (at least one), consecutive in one slab, or
        None (then use put_start: no slab to be had, or the batch does not fit in one). Call with ``lock`` held.
        Raises MasterUnreachable."""
        now = time.monotonic()
        slab = self._slab
        if slab is not None and slab.expires - now >= self.margin_s:
            offsets, end = slab_offsets(sizes, slab.front, slab.align)
            if end <= slab.end:
                slab.front = end
                return slab, offsets
        if self._disabled or now < self._retry_at or sum(sizes) > self.slab_bytes:
            return None
        slab = self._reserve(now)
        if slab is None:
            return None
        offsets, end = slab_offsets(sizes, slab.front, slab.align)
        if end > slab.end:
            return None
        slab.front = end
        return slab, offsets

    def renewed(self, slab: Slab, sent_at: float) -> None:
        """A ``put`` into ``slab`` sent at monotonic ``sent_at`` was answered: its lease runs from then."""
        slab.expires = sent_at + slab.ttl_s

    def forget(self) -> None:
        """Stop using the current slab (the master answered EXPIRED, a write into it failed, or the master did
        not answer): the next batch reserves a new one and releases this one."""
        if self._slab is not None:
            self._stale = [*self._stale[-63:], self._slab.id]
        self._slab = None

    def close(self) -> None:
        """Give the remainder back (best effort: the master frees it at expiry anyway)."""
        slab, self._slab = self._slab, None
        if slab is not None:
            try:
                self.rpc.call("reserve", [], {"release": [slab.id]})
            except StoreError as e:
                log.debug("releasing slab %d: %s", slab.id, e)

    def _reserve(self, now: float) -> Slab | None:
        self.forget()
        release, self._stale = self._stale, []
        try:
            [(code, value)] = self.rpc.call("reserve", [self.slab_bytes], {"release": release})
        except MasterUnreachable:
            raise
        except StoreError as e:  # refused as a request: a master without slabs
            log.info("the master does not offer reserve (%s): puts take put_start + put_commit", e)
            self._disabled = True
            return None
        if code != protocol.OK:
            wait = NO_SLABS_S if code == protocol.INVALID else RETRY_S
            self._retry_at = now + wait
            log.debug("reserve refused (%s): put_start for %.0f s", value, wait)
            return None
        sid, segment, region_id, offset, length, ttl_ms, align = value
        self._slab = Slab(sid, segment, region_id, offset, offset + length, align, ttl_ms / 1000, now + ttl_ms / 1000)
        return self._slab


def slab_offsets(sizes: list[int], front: int, align: int) -> tuple[list[int] | np.ndarray, int]:
    """Objects of ``sizes`` bytes back to back from ``front``, each rounded up to ``align`` (a power of two): their
    offsets and the end of the last. The offsets are an int list for at most transfer.spans.SMALL objects (the
    native calls' list form, as the engine gives such a batch's spans), else a uint64 array."""
    n, first = len(sizes), sizes[0]
    if n <= SMALL:
        ends = list(itertools.accumulate([-(-k // align) * align for k in sizes], initial=front))
        return ends[:-1], ends[-1]
    if sizes.count(first) == n:  # one size (KV pages): no arithmetic per object
        step = -(-first // align) * align
        return np.arange(front, front + n * step, step, dtype=np.uint64), front + n * step
    rounded = -(-np.asarray(sizes, dtype=np.int64) // align) * align  # sizes <= 2**48 (schema.MAX_SIZE)
    ends = np.cumsum(rounded) + front
    return (ends - rounded).astype(np.uint64), int(ends[-1])
