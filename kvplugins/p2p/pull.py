"""One get_replica's pull (kvplugins/p2p/store.py): every missing chunk read from a peer that holds it, several at
once, each verified against its xxh3_64 before it counts, the peer's holdings rewritten in the catalog as chunks
land (so later pullers read them from it, BitTorrent-like, while it still pulls).

Choice of the next (chunk, holder): the holder read least now, by this pull and the others (their
``reading_from`` lists: so reads spread over every holder's egress), a replica before the registering peer, and
from the registering peer a chunk no other puller is reading (their ``pending`` bitmaps: the registering peer's
egress is the scarce one, each chunk should leave it about once); then the rarest chunk (fewest holders and
readers), ties at random. A chunk that only the registering peer holds and another puller is reading is taken
only when this pull has nothing else in flight. While other pullers are listed (or before the catalog was read
again after this pull announced itself), a pull reads one chunk at a time from the registering peer: N pullers
each reading ``parallel`` chunks from it at once would share its egress N x parallel ways and land nothing to
serve each other for S / egress seconds.

A read that fails (a dead or unreachable peer, a timeout) or whose bytes do not match (a corrupt or lying peer)
is read again from another holder; the peer is not asked again for ``P2PConfig.lease_ttl_s`` (a failure: by then
a dead peer's holdings have left the catalog; a live but overloaded one is asked again) or for the rest of the
pull (a mismatch). The pull fails when no chunk could be read, and none was in flight, for ``stall_timeout_ms``.
No chunk is ever counted without its checksum matching.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvplugins import native
from kvplugins.errors import ChecksumMismatch, TransferFailed
from kvplugins.p2p.catalog import Catalog, Chunk, Holder, Payload
from kvplugins.p2p.config import P2PConfig
from kvplugins.transfer import Region, SegmentDescriptor, TransferEngine, TransferRequest

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (bytes verified so far, bytes in all)


@dataclass
class PullStats:
    """What a get_replica did: ``bytes`` pulled in ``seconds``; bytes per serving peer (segment id); chunk reads
    that failed (``failed``) or came back with wrong bytes (``mismatched``), each then read again elsewhere."""

    name: str
    bytes: int = 0
    seconds: float = 0.0
    chunks: int = 0
    from_peers: dict[str, int] = field(default_factory=dict)
    failed: int = 0
    mismatched: int = 0


def chunk_digest(addr: int, length: int) -> int:
    """xxh3_64 of ``length`` bytes at ``addr`` (native, no copy)."""
    one = np.zeros(1, dtype=np.uint64)
    return int(native.hash_keys(np.array([addr], dtype=np.uint64), np.array([length], dtype=np.uint64), one, 1)[0])


class Pull:
    """Pulls ``payload`` into local ``regions`` (one per buffer, registered with ``engine``). ``publish(have)``
    writes this peer's holdings to the catalog (bitmaps of the chunks verified and of those being read). ``run()`` returns PullStats or raises
    ChecksumMismatch (every holder of a chunk served wrong bytes) or TransferFailed (no live holder of a
    missing chunk for ``stall_timeout_ms``); either names the chunk."""

    def __init__(
        self,
        cfg: P2PConfig,
        engine: TransferEngine,
        catalog: Catalog,
        payload: Payload,
        regions: list[Region],
        me: str,
        publish: Callable[[bytes, bytes, list[str]], None],
        progress: Progress | None = None,
    ):
        self.cfg, self.engine, self.catalog, self.p = cfg, engine, catalog, payload
        self.regions, self.me, self.publish, self.progress = regions, me, publish, progress
        self.stats = PullStats(payload.name)
        self.have = bytearray((len(payload.chunks) + 7) // 8)
        self.missing = set(range(len(payload.chunks)))
        self.inflight: dict[int, str] = {}
        self.reading: dict[str, int] = {}  # peer -> chunks read from it now
        self.shunned: dict[str, float] = {}  # peer -> monotonic time it may be asked again
        self.mismatch: dict[int, set[str]] = {}  # chunk -> peers that served it wrong
        self.holders: list[tuple[Holder, SegmentDescriptor]] = []
        self.crowd = False  # other pullers are listed
        self.idle_since: float | None = None  # since when no chunk could be read and none was in flight
        self.error: Exception | None = None
        self.done_bytes = 0
        self.published: tuple[bytes, bytearray, list[str]] = (bytes(self.have), bytearray(len(self.have)), [])
        self.cond = threading.Condition()
        self.rng = random.Random()
        self.finished = threading.Event()
        self.ticked = False  # the catalog was read again after this pull announced itself

    def run(self) -> PullStats:
        """Pulls with ``parallel`` worker threads and one catalog thread (reads who holds what, publishes what
        this peer holds: etcd round trips never hold up a chunk read). Returns once every chunk is verified
        and published."""
        t0 = time.monotonic()
        self.holders, self.crowd = self._holders()
        ticker = threading.Thread(target=self._tick, name="p2p-catalog", daemon=True)
        workers = [
            threading.Thread(target=self._work, name=f"p2p-pull-{i}", daemon=True) for i in range(self.cfg.parallel)
        ]
        ticker.start()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        self.finished.set()
        ticker.join()
        if self.error is not None:
            raise self.error
        self._announce()
        self.stats.seconds = time.monotonic() - t0
        return self.stats

    # -- the catalog ------------------------------------------------------------------------------
    def _holders(self) -> tuple[list[tuple[Holder, SegmentDescriptor]], bool]:
        """(the holders this pull may read from, whether other pullers are listed)."""
        listed = [(h, d) for h, d in self.catalog.holders(self.p) if h.peer != self.me]
        crowd = any(not h.gold for h, _ in listed)
        return ([(h, d) for h, d in listed if h.gold] if self.cfg.sources == "owner" else listed), crowd

    def _tick(self) -> None:
        """Every refresh_ms until the pull ends: publish this peer's new chunks, read the holders again."""
        while not self.finished.wait(max(self.cfg.refresh_ms, 10) / 1000):
            try:
                self._announce()
                holders, crowd = self._holders()
            except Exception as e:  # noqa: BLE001 - etcd away: keep pulling from the holders known
                log.warning("p2p %r: catalog not read (%s); pulling from the holders known", self.p.name, e)
                continue
            with self.cond:
                self.holders, self.crowd, self.ticked = holders, crowd, True
                self.cond.notify_all()

    def _announce(self) -> None:
        with self.cond:
            have = bytes(self.have)
            pending = bytearray(len(have))
            inflight = {} if self.finished.is_set() else self.inflight
            for c in inflight:
                pending[c >> 3] |= 1 << (c & 7)
            sources = sorted(inflight.values())
        if (have, pending, sources) != self.published:
            self.publish(have, bytes(pending), sources)
            self.published = (have, pending, sources)

    # -- choosing ---------------------------------------------------------------------------------

    def _pick(self) -> tuple[int, Holder, SegmentDescriptor] | None:
        now = time.monotonic()
        live = [(h, d) for h, d in self.holders if self.shunned.get(h.peer, 0) <= now]
        alone = self.ticked and not self.crowd
        load: dict[str, int] = {}  # reads of each holder now: the other pullers' (as listed) and ours
        for h, _ in self.holders:
            for peer in h.reading_from:
                load[peer] = load.get(peer, 0) + 1
        for peer, n in self.reading.items():
            load[peer] = load.get(peer, 0) + n
        owner_cap = self.cfg.parallel if alone else 1
        best: tuple[tuple[int, int, int, float], int, Holder, SegmentDescriptor] | None = None
        for c in self.missing:
            if c in self.inflight:
                continue
            bad = self.mismatch.get(c, ())
            hs = [(h, d) for h, d in live if h.has(c) and h.peer not in bad]
            readers = sum(1 for h, _ in self.holders if h.reads(c))
            for h, d in hs:
                if h.gold and self.reading.get(h.peer, 0) >= owner_cap:
                    continue
                tier = 0 if not h.gold else 1 if readers == 0 else 2
                key = (load.get(h.peer, 0), tier, len(hs) + readers, self.rng.random())
                if best is None or key < best[0]:
                    best = (key, c, h, d)
        if best is None or (best[0][1] == 2 and self.inflight):
            return None
        return best[1], best[2], best[3]

    # -- working ----------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            while True:
                with self.cond:
                    job = self._next()
                    if job is None:
                        return
                c, h, d = job
                self._read(c, h, d)
        except Exception as e:  # noqa: BLE001 - handed to run(); every worker stops
            with self.cond:
                self.error = self.error or e
                self.cond.notify_all()

    def _next(self) -> tuple[int, Holder, SegmentDescriptor] | None:
        """Under the lock: the next (chunk, holder, descriptor) to read, waiting while none can be read yet;
        None when the pull is done or failed."""
        while self.missing and self.error is None:
            job = self._pick()
            if job is not None:
                c, h, _ = job
                self.inflight[c] = h.peer
                self.reading[h.peer] = self.reading.get(h.peer, 0) + 1
                self.idle_since = None
                return job
            now = time.monotonic()
            if self.inflight:
                self.idle_since = None
            elif self.idle_since is None:
                self.idle_since = now
            elif now - self.idle_since > self.cfg.stall_timeout_ms / 1000:
                self.error = self._stalled()
                self.cond.notify_all()
                return None
            self.cond.wait(max(self.cfg.refresh_ms, 10) / 1000)
        return None

    def _stalled(self) -> Exception:
        c = min(self.missing)
        if c in self.mismatch:
            return ChecksumMismatch(
                f"p2p {self.p.name!r}: chunk {c} came back with wrong bytes from every holder that has it "
                f"({', '.join(sorted(self.mismatch[c]))}); nothing was kept"
            )
        return TransferFailed(
            f"p2p {self.p.name!r}: no live peer holds chunk {c} (and {len(self.missing) - 1} more missing) for "
            f"{self.cfg.stall_timeout_ms:.0f} ms; {len(self.holders)} holders listed. Is the registering peer "
            "(or any replica) still running?"
        )

    def _read(self, c: int, h: Holder, d: SegmentDescriptor) -> None:
        chunk: Chunk = self.p.chunks[c]
        region = self.regions[chunk.buffer]
        req = TransferRequest(region, chunk.offset, d, h.regions[chunk.buffer], chunk.offset, chunk.length)
        t0 = time.monotonic()
        err = self.engine.batch_read([req], timeout_ms=self.cfg.chunk_timeout_ms)[0]
        log.debug("p2p %r: chunk %d from %s in %.3f s", self.p.name, c, h.peer, time.monotonic() - t0)
        ok = err is None and chunk_digest(region.addr + chunk.offset, chunk.length) == chunk.xxh3
        with self.cond:
            del self.inflight[c]
            self.reading[h.peer] -= 1
            if ok:
                self._landed(c, h.peer, chunk.length)
            elif err is not None:
                log.warning("p2p %r: chunk %d from %s failed (%s); reading it elsewhere", self.p.name, c, h.peer, err)
                self.stats.failed += 1
                self.shunned[h.peer] = time.monotonic() + self.cfg.lease_ttl_s
            else:
                log.warning(
                    "p2p %r: chunk %d from %s did not match its checksum; reading it elsewhere", self.p.name, c, h.peer
                )
                self.stats.mismatched += 1
                self.mismatch.setdefault(c, set()).add(h.peer)
            self.cond.notify_all()
            done = self.done_bytes
        if ok and self.progress is not None:
            self.progress(done, self.p.size)

    def _landed(self, c: int, peer: str, length: int) -> None:
        self.missing.discard(c)
        self.have[c >> 3] |= 1 << (c & 7)
        self.done_bytes += length
        self.stats.bytes += length
        self.stats.chunks += 1
        self.stats.from_peers[peer] = self.stats.from_peers.get(peer, 0) + length
