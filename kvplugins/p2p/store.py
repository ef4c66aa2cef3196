"""``P2PStore``: Mooncake P2P Store's model (mooncake-p2p-store/src/p2pstore/core.go) on kvplugins.transfer: no
master, a catalog in etcd (catalog.py), each peer serving the memory it registered or pulled.

Lifecycle of a P2PStore (one per process), in call order:
  1. ``P2PStore(config)``           opens the catalog (etcd) and starts a TransferEngine (host, transports and the
                                    batch timeout, chunk_timeout_ms, from the config, the rest from
                                    KVPLUGINS_TRANSFER_*), or uses the ``engine`` given.
  2. ``register(name, buffers)``    seeds an object: no copy; the buffers are registered read-only to peers, cut into
                                    chunks, checksummed once, and listed in the catalog with this peer as its holder
                                    (the "gold" copy). Returns the Payload.
     ``get_replica(name, buffers)`` pulls an object into the caller's buffers (sized as registered) from every peer
                                    that holds its chunks, several chunks at once, each verified; from its first
                                    chunk on it serves what it holds to later pullers (pull.py). Returns PullStats.
  3. ``list(prefix)``               the objects in the catalog (PayloadInfo: sizes, chunks, live holders).
  4. ``delete_replica(name)``       stops serving a replica; ``unregister(name)`` stops serving a registered object
                                    and, if no peer holds it any more, removes it from the catalog. The caller's
                                    buffers are its own again after either.
  5. ``close()``                    revokes this peer's etcd lease (its holdings leave the catalog at once) and
                                    unregisters its memory; a peer that dies leaves when the lease ends.

Trust: transfers run over the transfer core's authenticated connections (the cluster secret; the per-user one on
one host); peers may only read the memory a P2PStore registers, never write it (Region.peer_readonly); catalog
records are typed and checked; every chunk's bytes are checked against the registering peer's xxh3_64.
Thread-safe: distinct names may be registered and pulled from several threads at once.
"""

from __future__ import annotations

import builtins
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvplugins import native
from kvplugins.errors import ConfigError, KeyNotFound, SizeMismatch, StoreError
from kvplugins.p2p.catalog import Catalog, Chunk, Holder, Payload, check_name, check_payload, cut
from kvplugins.p2p.config import P2PConfig
from kvplugins.p2p.pull import Progress, Pull, PullStats
from kvplugins.transfer import Region, TransferEngine
from kvplugins.transfer.config import transfer_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PayloadInfo:
    """An object as ``list`` shows it: ``sizes`` (bytes per buffer), ``chunks`` of at most ``chunk_bytes``,
    ``holders`` live now, ``complete`` of them holding every chunk, ``owner`` the registering peer."""

    name: str
    size: int
    sizes: tuple[int, ...]
    chunk_bytes: int
    chunks: int
    holders: int
    complete: int
    owner: str
    labels: tuple[str, ...] = ()


@dataclass
class _Held:
    payload: Payload
    regions: list[Region]
    holder: Holder | None  # None until it holds a chunk


class P2PStore:
    def __init__(self, config: P2PConfig | None = None, engine: TransferEngine | None = None):
        self.cfg = config or P2PConfig()
        if not self.cfg.etcd:
            raise ConfigError("p2p needs the catalog's etcd: --etcd etcd://host:port[/prefix] or KVPLUGINS_P2P_ETCD")
        self.catalog = Catalog(self.cfg.etcd)
        self._own = engine is None
        # A chunk's read is one batch: its deadline is the engine's (the server's frame timeout follows it, twice).
        tc = transfer_config(host=self.cfg.host, transports=self.cfg.transports, timeout_ms=self.cfg.chunk_timeout_ms)
        self.engine = engine or TransferEngine(tc)
        self.me = self.engine.segment_id
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._lease = 0
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    # -- seeding ----------------------------------------------------------------------------------
    def register(
        self,
        name: str,
        buffers: Sequence[object],
        chunk_bytes: int = 0,
        force: bool = False,
        labels: Sequence[str] = (),
    ) -> Payload:
        """Seed ``name`` = the concatenation of ``buffers`` (anything TransferEngine.register takes, or (address,
        bytes) pairs; the caller keeps them alive and unchanged until unregister), cut into chunks of
        ``chunk_bytes`` (0: the config's). ``force`` replaces an object of that name (its old holders stop
        counting). ``labels``: none or one string per buffer, kept with the object (e.g. file names). Raises StoreError (the name exists, or etcd does not answer), ConfigError (a bad name or
        chunk size, held here already), TypeError/OutOfRange (memory the engine cannot register)."""
        check_name(name)
        if labels and len(labels) != len(buffers):
            raise ConfigError(
                f"p2p register({name!r}): {len(labels)} labels for {len(buffers)} buffers; give one per buffer"
            )
        step = int(chunk_bytes or self.cfg.chunk_bytes)
        if step < 1:
            raise ConfigError(f"p2p register({name!r}): chunk_bytes={chunk_bytes} must be >= 1")
        regions = self._claim(name, buffers)
        try:
            sizes = [r.length for r in regions]
            spans = cut(sizes, step)
            sums = _digests(regions, spans)
            chunks = [Chunk(b, off, n, s) for (b, off, n), s in zip(spans, sums)]
            p = Payload(name, secrets.token_hex(8), sizes, step, chunks, self.me, int(time.time() * 1000), list(labels))
            check_payload(p)
            if not self.catalog.create(p, force):
                owner = getattr(self.catalog.get(name), "owner", "?")
                raise StoreError(f"p2p object {name!r} exists (registered by {owner}); pass force to replace it")
            self._hold(name, _Held(p, regions, None), bytes([0xFF]) * ((len(chunks) + 7) // 8), gold=True)
            return p
        except BaseException:
            self._release(name)
            raise

    def get_replica(self, name: str, buffers: Sequence[object], progress: Progress | None = None) -> PullStats:
        """Pull ``name`` into ``buffers`` (as register takes them; one per registered buffer, each exactly its
        size), then keep serving it until delete_replica or close. ``progress(done_bytes, total_bytes)`` is
        called as chunks land. Raises KeyNotFound (no such object), SizeMismatch (naming the buffer and both
        sizes), ChecksumMismatch / TransferFailed (pull.py), StoreError (etcd); on any of them nothing is
        served and the buffers are the caller's again (their bytes undefined)."""
        p = self.catalog.get(check_name(name))
        if p is None:
            raise KeyNotFound(f"p2p object {name!r} is not in the catalog at {self.cfg.etcd} (see kvplugins p2p list)")
        regions = self._claim(name, buffers)
        try:
            got = [r.length for r in regions]
            if got != p.sizes:
                i = next((i for i, (a, b) in enumerate(zip(got, p.sizes)) if a != b), min(len(got), len(p.sizes)))
                raise SizeMismatch(
                    f"p2p get_replica({name!r}): buffers of {got[:8]} bytes, the object has {p.sizes[:8]} "
                    f"({len(p.sizes)} buffers; first difference at buffer {i}); pass buffers of those sizes"
                )
            held = _Held(p, regions, None)
            with self._lock:
                self._held[name] = held
            pull = Pull(
                self.cfg,
                self.engine,
                self.catalog,
                p,
                regions,
                self.me,
                lambda have, pending, sources: self._hold(name, held, have, pending, sources),
                progress,
            )
            return pull.run()
        except BaseException:
            self._release(name)
            raise

    # -- leaving ----------------------------------------------------------------------------------
    def unregister(self, name: str) -> None:
        """Stop serving ``name`` (registered or pulled here); when no peer holds it any more, remove it from the
        catalog. Raises KeyNotFound when this peer does not hold it, StoreError (etcd)."""
        held = self._release(name, must=True)
        self.catalog.delete_if_unheld(held.payload)

    def delete_replica(self, name: str) -> None:
        """Stop serving the replica of ``name`` pulled here. Raises KeyNotFound when this peer holds no replica of
        it (a registered object: unregister), StoreError (etcd)."""
        with self._lock:
            held = self._held.get(name)
        if held is not None and held.holder is not None and held.holder.gold:
            raise KeyNotFound(f"p2p {name!r} was registered here, not replicated: use unregister({name!r})")
        self._release(name, must=True)

    def list(self, prefix: str = "") -> builtins.list[PayloadInfo]:
        """The catalog's objects whose names start with ``prefix``, oldest first. Raises StoreError (etcd)."""
        out = []
        for p in self.catalog.payloads(prefix):
            hs = self.catalog.holders(p)
            full = len([h for h, _ in hs if all(h.has(c) for c in range(len(p.chunks)))])
            out.append(
                PayloadInfo(
                    p.name,
                    p.size,
                    tuple(p.sizes),
                    p.chunk_bytes,
                    len(p.chunks),
                    len(hs),
                    full,
                    p.owner,
                    tuple(p.labels),
                )
            )
        return out

    def holding(self) -> builtins.list[str]:
        """The names this peer serves now."""
        with self._lock:
            return sorted(self._held)

    def close(self) -> None:
        """Leave: the lease revoked (holdings gone from the catalog at once), memory unregistered, the engine closed
        when this store started it. Idempotent; never raises for an unreachable etcd (logged)."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join()
        with self._lock:
            names, lease, self._lease = list(self._held), self._lease, 0
        for name in names:
            self._release(name, withdraw=False)
        if lease:
            try:
                self.catalog.etcd.revoke(lease)
            except StoreError as e:
                log.warning("p2p close: etcd did not take the lease back (%s); holdings leave when it ends", e)
        if self._own:
            self.engine.close()

    def __enter__(self) -> "P2PStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------
    def _claim(self, name: str, buffers: Sequence[object]) -> builtins.list[Region]:
        """Registers ``buffers`` for ``name`` (exported, read-only to peers). Raises ConfigError when ``name``
        is held here already or ``buffers`` is empty."""
        if not len(buffers):
            raise ConfigError(f"p2p {name!r}: no buffers given; pass at least one")
        with self._lock:
            if name in self._held:
                raise ConfigError(f"p2p {name!r} is held by this peer already; unregister or delete_replica it first")
            self._held[name] = _Held(Payload(name, "", [], 0, [], "", 0), [], None)  # reserved
        regions: builtins.list[Region] = []
        try:
            for b in buffers:
                mem, n = (b[0], b[1]) if isinstance(b, tuple) else (b, None)
                regions.append(self.engine.register(mem, n, export=True, peer_readonly=True))
        except BaseException:
            for r in regions:
                self.engine.unregister(r)
            with self._lock:
                self._held.pop(name, None)
            raise
        self._held[name].regions = regions
        return regions

    def _hold(
        self, name: str, held: _Held, have: bytes, pending: bytes = b"", sources: Sequence[str] = (), gold: bool = False
    ) -> None:
        """Publish this peer's holdings ``have`` of ``name`` (with the chunks it reads now, ``pending``, and their
        ``sources``) under its lease (granted on first use)."""
        desc = self.engine.descriptor().to_wire()
        regions = [r.region_id for r in held.regions]
        held.holder = Holder(held.payload.gen, self.me, gold, desc, regions, have, pending, list(sources))
        with self._lock:
            self._held[name] = held
        self.catalog.publish(name, held.holder, self._lease_id())

    def _lease_id(self) -> int:
        with self._lock:
            if self._lease:
                return self._lease
        lease = self.catalog.etcd.lease(self.cfg.lease_ttl_s)
        with self._lock:
            if self._lease:  # another thread won: ours lapses
                return self._lease
            self._lease = lease
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep, name="p2p-lease", daemon=True)
                self._keeper.start()
        return lease

    def _keep(self) -> None:
        """Refresh the lease every third of its TTL; when it lapsed (etcd was away), take a new one and publish
        every holding again."""
        while not self._stop.wait(self.cfg.lease_ttl_s / 3):
            with self._lock:
                lease = self._lease
            try:
                if self.catalog.etcd.refresh(lease) > 0:
                    continue
                log.warning("p2p: the etcd lease lapsed; publishing this peer's holdings again")
                with self._lock:
                    self._lease = 0
                    helds = [(n, held, held.holder) for n, held in self._held.items() if held.holder is not None]
                for name, held, h in helds:
                    self._hold(name, held, h.have, h.pending, h.reading_from, h.gold)
            except StoreError as e:
                log.warning("p2p: lease refresh failed (%s); retrying", e)

    def _release(self, name: str, must: bool = False, withdraw: bool = True) -> _Held:
        with self._lock:
            held = self._held.pop(name, None)
        if held is None:
            if must:
                raise KeyNotFound(
                    f"p2p {name!r} is not held by this peer (holding: {', '.join(self.holding()) or 'none'})"
                )
            return _Held(Payload(name, "", [], 0, [], "", 0), [], None)
        try:
            if withdraw and held.holder is not None:
                self.catalog.withdraw(name, self.me)
        finally:
            for r in held.regions:
                self.engine.unregister(r)
        return held


def _digests(regions: list[Region], spans: list[tuple[int, int, int]]) -> list[int]:
    """xxh3_64 of each (buffer, offset, length) span of ``regions``, natively."""
    addrs = np.array([regions[b].addr + off for b, off, _ in spans], dtype=np.uint64)
    lens = np.array([n for _, _, n in spans], dtype=np.uint64)
    got = native.hash_keys(addrs, lens, np.arange(len(spans), dtype=np.int64), len(spans), threads=2)
    return [int(x) for x in got]
