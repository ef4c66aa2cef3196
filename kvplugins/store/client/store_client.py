"""StoreClient: put/get objects in the pool. Metadata goes to the master (raw framed RPC, one round trip per
batch); bytes go through the transfer core (kvplugins/transfer) directly between this process's registered
memory and the segments, never through the master.

Put (one replica, no pin or preferred segment: the default): one transfer batch writes the spans into space this
client reserved earlier (a slab) -> ``put`` with each object's xxh3_64 (complete): ONE master round trip
(slab.py, master/slabs.py). Otherwise, or when no slab space is to be had: ``put_start`` (master
allocates, object pending) -> one transfer batch writes every span to every replica -> ``put_commit`` with each
object's xxh3_64 (complete; ``put_abort`` for entries whose transfer failed).
With shm the engine's first choice, a get and a slab put of up to NATIVE_MAX_BYTES run as ONE native call
(native.get_many / put_many: the RPC on this client's connection, the copies + xxh3 out of / into the same-host mappings, the
checksum and lease checks); the keys it does not finish go on below from the same reply.
Get: ``get`` (lookup + lease) -> one transfer batch reads the spans -> the bytes are checked against the
checksum (a mismatch tries the next replica, is reported to the master with ``report_corrupt``, and with no good
replica left is a ChecksumMismatch miss). A transfer group that ends after the get's lease fails its entries with
LeaseExpired (never stale bytes); those alone are read again under a new lease, up to LEASE_ROUNDS times.
Placement per put: store/placement.py PutConfig (replicas, preferred segment, soft/hard pin).
Errors (kvplugins/errors.py): KeyNotFound (ChecksumMismatch), StoreFull, BufferNotRegistered, SizeMismatch,
MasterUnreachable, TransferFailed. Follows the Mooncake store client design (FAST'25 §4).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time

import numpy as np

from kvplugins import native
from kvplugins.config import load
from kvplugins.errors import (
    BufferNotRegistered,
    ChecksumMismatch,
    ConfigError,
    KeyNotFound,
    MasterUnreachable,
    NativeError,
    PutPending,
    SizeMismatch,
    StoreError,
    TransferError,
    LeaseExpired,
    TransferFailed,
)
from kvplugins.security import roles
from kvplugins.store import embedded
from kvplugins.store.client import batches, checksum, promote
from kvplugins.store.client.connect import master_client
from kvplugins.store.client.follower import LeaderClient
from kvplugins.store.client.rpc import RawRpcClient
from kvplugins.store.client.slab import SlabSpace
from kvplugins.store.client.stats import ClientStats
from kvplugins.store.config import ClientConfig, StoreNodeConfig
from kvplugins.store.node.disk.worker import NodeTier
from kvplugins.store.node.segment import OwnedSegment
from kvplugins.store.placement import PutConfig, from_client
from kvplugins.store.wire import protocol, replies
from kvplugins.store.wire.replies import Found, Location
from kvplugins.transfer import SegmentDescriptor, TransferEngine
from kvplugins.transfer.config import transfer_config
from kvplugins.transfer.staging import StagingPool

log = logging.getLogger(__name__)
GRANTS_PRUNED_PAST = 4096  # put-session grants kept before the expired ones are dropped (put_start)
LEASE_ROUNDS = 3  # re-reads of the entries whose read ended after its lease (LeaseExpired), each under a new lease
# Batches up to this many bytes run as one native call: it copies while holding the master connection's lock, so a
# bigger batch takes the general path (copies outside that lock, where other threads' requests go on meanwhile).
NATIVE_MAX_BYTES = 4 << 20
Span = tuple[int, int]  # (address, nbytes) inside a registered buffer


class StoreClient:
    """A client of the store at ``config.master`` ('' = the embedded `kvplugins up`, started if needed).
    Raises MasterUnreachable if the master does not answer ``info`` within ``rpc_timeout_ms``. Thread-safe."""

    def __init__(self, config: ClientConfig | None = None):
        self.cfg = cfg = config or load(ClientConfig)
        self._put_cfg = from_client(cfg)
        if cfg.master:
            self.master = cfg.master
        else:
            self.master = embedded.ensure_running(cfg.embedded_start_timeout_ms / 1000)
        self._sharded = self.master.startswith("shards://")  # kvplugins/store/cluster: no slabs, no columns
        if self._sharded and cfg.segment_size:
            raise ConfigError(
                f"segment_size={cfg.segment_size}: a client of a sharded store ({self.master}) cannot "
                f"contribute a segment; run `kvplugins store --master {self.master}` nodes instead"
            )
        self._rpc = master_client(self.master, cfg.rpc_timeout_ms)
        self._put_ttl_s = _put_ttl_s(self._rpc.call("info"))
        self._grants: dict[str, float] = {}  # put session key -> write deadline (put_start below)
        self._prune_grants_at = GRANTS_PRUNED_PAST
        self._engine = TransferEngine(
            transfer_config(
                host=cfg.host,
                transports=cfg.transports,
                timeout_ms=float(cfg.transfer_timeout_ms),
                rdma_devices=cfg.rdma_devices or None,
            )
        )
        self._descs: dict = {}
        # one-call ops (native.get_many/put_many) over a single master's connection: the bytes through the shm
        # transport's mappings (shm the engine's first choice) or the TCP transport's pooled connections
        # (an HA master too: LeaderClient.held; a failed exchange there goes on through the retrying Python path)
        self._ha = type(self._rpc) is LeaderClient and self._rpc.plane == "raw"
        one_call = self._one_call = type(self._rpc) is RawRpcClient or self._ha
        self._shm_maps = self._engine.shm_maps() if one_call else None
        self._tcp_peers = self._engine.tcp_peers() if one_call else None
        self._tcp_routed: set[str] = set()  # segments (the master's names) with a region routed in _tcp_peers
        self._one_call_maps = self._shm_maps
        if self._one_call_maps is None and self._tcp_peers is not None:
            self._one_call_maps = native.shm_maps()  # none mapped: the native get reads over TCP only
        self._buffers: dict[int, object] = {}
        self._staging = StagingPool.registered(self._engine, cfg.staging_size)
        self._slabs = (
            SlabSpace(self._rpc, cfg.slab_bytes, (cfg.transfer_timeout_ms + cfg.rpc_timeout_ms) / 1000)
            if cfg.slab_bytes and cfg.wait_commit and not self._sharded
            else None
        )
        self._stats = ClientStats()
        self._segment = self._segment_rpc = self._segment_link = self._admin_rpc = None
        self._admin_lock = threading.Lock()
        self._closed = False
        if cfg.segment_size:
            try:
                self._own_segment(cfg)
            except BaseException:
                self.close()  # nothing stays registered when the client does not start
                raise

    def _own_segment(self, cfg: ClientConfig) -> None:
        """Register ``segment_size`` bytes as this client's segment, with its command link (_command_link)."""
        self._segment_rpc = master_client(self.master, cfg.rpc_timeout_ms, "node")  # needs a node credential
        self._segment = OwnedSegment(self._engine, cfg.segment_size, self._segment_rpc, cfg.heartbeat_interval_ms)
        self._segment_link = _command_link(cfg, self._engine, self._segment, self.master, self._segment_drained)

    def _segment_drained(self) -> None:
        """The master drained the own segment (the link's thread calls this): unregister it; the client goes on
        without one."""
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.close()

    # ---- buffers -------------------------------------------------------------------------------------
    def register_buffer(self, mem, length: int | None = None):
        """Register memory (numpy array, torch CPU tensor, memoryview, bytearray, or int address + length)
        for zero-copy put_from/get_into. Returns its Region."""
        region = self._engine.register(mem, length=length)
        self._buffers[id(mem)] = region
        return region

    def unregister_buffer(self, region_or_mem) -> None:
        """Unregister a Region (or the object given to register_buffer). Raises BufferNotRegistered."""
        region = self._buffers.pop(id(region_or_mem), None) or region_or_mem
        if not hasattr(region, "region_id"):
            raise BufferNotRegistered(f"{type(region_or_mem).__name__} was never passed to register_buffer")
        self._buffers = {k: r for k, r in self._buffers.items() if r != region}
        self._engine.unregister(region)

    # ---- zero-copy -----------------------------------------------------------------------------------
    def put_from(self, key: str, spans: list[Span], config: PutConfig | None = None) -> None:
        """Store the concatenation of ``spans`` (address, nbytes) under ``key``. A complete key is a no-op.
        ``config``: placement of this put (store/placement.py); None = the ClientConfig defaults."""
        _raise_first(self.batch_put_from([key], [spans], config))

    def get_into(self, key: str, spans: list[Span]) -> None:
        """Scatter object ``key`` into ``spans``. Raises KeyNotFound, SizeMismatch (sum of lengths != size)."""
        if self._one_call_maps is not None and type(key) is str:
            cols = self._one_key_spans(spans)
            done = self._read_native([key], [spans], cols) if cols is not None else None
            if done is not None:
                _raise_first(done)
                return
        _raise_first(self.batch_get_into([key], [spans]))

    def _read_native(self, keys: list[str], spans_per_key: list, spans: tuple) -> list[StoreError | None] | None:
        """batch_get_into in one native call (native.get_many); ``spans``: the batch's (addresses, lengths, key
        starts, bytes per key) in writable registered memory (engine.writable_spans). The keys it leaves go on from
        its reply (_read). None where it does not apply (nothing was sent, or an HA master's leader did not
        answer: the Python path retries on the next one)."""
        t0, lease_t0 = time.perf_counter(), time.monotonic()
        maps, peers, verify = self._one_call_maps, self._tcp_peers, self.cfg.verify_checksums
        try:
            with self._rpc.held("get") as h:
                try:
                    codes, body, tcp = native.get_many(
                        h.fd, h.rid, keys, *spans[:3], h.ms, maps, verify, peers, self.cfg.transfer_timeout_ms
                    )
                except (OSError, TimeoutError) as e:
                    raise h.failed(e) from e
                except TypeError:  # a key that is not a str
                    return None
                cols = h.payload(body) if body is not None else None
        except MasterUnreachable:
            if self._ha:
                return None
            raise
        ran = codes if tcp is None else tcp.run(codes)  # TCP reads, the master's connection free again
        out: list[StoreError | None] = [None if c != 1 else KeyNotFound(k) for k, c in zip(keys, ran)]
        if body is not None:  # some key is for Python (code 2): it goes on from the reply
            later = [i for i, c in enumerate(codes) if c == 2]
            found = self._cols_found(cols)
            sub = [keys[i] for i in later], [spans_per_key[i] for i in later], [found[i] for i in later]
            for i, err in zip(later, self._read(*sub, lease_t0)[0]):
                out[i] = err
        if tcp is not None and 2 in ran:  # a TCP read that did not end well: looked up and read again in Python
            again = [i for i, (c, r) in enumerate(zip(codes, ran)) if c == 6 and r == 2]
            for i, err in zip(again, self._read([keys[i] for i in again], [spans_per_key[i] for i in again])[0]):
                out[i] = err
        if body is not None or 2 in ran:
            self._read_late_again(keys, spans_per_key, out)
        self._stats.record("get", spans[3], out, t0)
        return out

    def _one_key_spans(self, spans) -> tuple | None:
        """engine.writable_spans of one key's spans, as int lists (a single get_into)."""
        addrs, lens = [], []
        for addr, n in spans:
            if type(addr) is not int or type(n) is not int or addr < 0 or n <= 0:
                return None
            try:
                if self._engine.region_for(addr, n).readonly:
                    return None
            except BufferNotRegistered:
                return None
            addrs.append(addr)
            lens.append(n)
        return (addrs, lens, [0, len(addrs)], [sum(lens)]) if addrs and sum(lens) <= NATIVE_MAX_BYTES else None

    def batch_put_from(
        self, keys: list[str], spans_per_key: list[list[Span]], config: PutConfig | None = None
    ) -> list[StoreError | None]:
        """One allocate RPC + one transfer batch + one commit RPC for all keys. Per-key None or the error
        (StoreFull names hard-pinned objects when they hold the space). ``config``: as put_from."""
        t0 = time.perf_counter()
        out, sizes = self._write(list(keys), list(spans_per_key), config or self._put_cfg)
        self._stats.record("put", sizes, out, t0)
        return out

    def batch_get_into(self, keys: list[str], spans_per_key: list[list[Span]]) -> list[StoreError | None]:
        """One lookup RPC + one transfer batch. Per-key None, KeyNotFound (ChecksumMismatch when no replica's
        bytes matched the checksum), SizeMismatch or TransferFailed."""
        keys, spans_per_key = list(keys), list(spans_per_key)
        if self._one_call_maps is not None and keys and len(keys) == len(spans_per_key):
            spans = self._engine.writable_spans(spans_per_key)
            small = spans is not None and spans[4] <= NATIVE_MAX_BYTES
            done = self._read_native(keys, spans_per_key, spans) if small else None
            if done is not None:
                return done
        return self._read_batch(keys, spans_per_key, time.perf_counter())

    def _read_batch(self, keys: list[str], spans_per_key: list, t0: float) -> list[StoreError | None]:
        read = self._read_cols if len(keys) > batches.SMALL and not self._sharded else self._read
        out, sizes = read(keys, spans_per_key)
        self._read_late_again(keys, spans_per_key, out)
        self._stats.record("get", sizes, out, t0)
        return out

    # ---- bytes forms (through the registered staging buffer) ----------------------------------------
    def put(self, key: str, data, config: PutConfig | None = None) -> None:
        """Store ``data`` (bytes-like) under ``key``. ``config``: as put_from."""
        _raise_first(self.batch_put([key], [data], config))

    def get(self, key: str) -> bytes:
        """The bytes stored under ``key``. Raises KeyNotFound."""
        value = self.batch_get([key])[0]
        if isinstance(value, StoreError):
            raise value
        return value

    def batch_put(self, keys: list[str], datas: list, config: PutConfig | None = None) -> list[StoreError | None]:
        """Store each bytes-like ``datas[i]`` under ``keys[i]`` (copied through the staging buffer, then one
        allocate RPC + one transfer batch + one commit RPC). Per key: None or the StoreError. ``config``: as
        put_from."""
        views = [memoryview(d).cast("B") for d in datas]
        with self._staging.slot(nbytes=sum(v.nbytes for v in views)) as slot:
            base, mv, spans, off = slot.addr, self._staging.view(slot), [], 0
            for v in views:
                mv[off : off + v.nbytes] = v
                spans.append([(base + off, v.nbytes)] if v.nbytes else [])
                off += v.nbytes
            return self.batch_put_from(keys, spans, config)

    def batch_get(self, keys: list[str]) -> list:
        """Per key: the bytes, or the StoreError (KeyNotFound for a miss)."""
        keys, t0, lease_t0 = list(keys), time.perf_counter(), time.monotonic()
        found = self._lookup(keys)
        sizes = [v.size if c == protocol.OK else 0 for c, v in found]
        with self._staging.slot(nbytes=sum(sizes)) as slot:
            base, mv, spans, off = slot.addr, self._staging.view(slot), [], 0
            for n in sizes:
                spans.append([(base + off, n)] if n else [])
                off += n
            errs, _ = self._read(keys, spans, found, lease_t0)
            self._read_late_again(keys, spans, errs)
            self._stats.record("get", sizes, errs, t0)
            return [
                e if e is not None else bytes(mv[s[0][0] - base : s[0][0] - base + s[0][1]])
                for e, s in zip(errs, spans)
            ]

    # ---- metadata ------------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: list[str]) -> list[bool]:
        """Whether each key is stored complete; one RPC (with one master or an HA pair, sent and answered in one
        native exchange: native.shard_exists over this client's connection)."""
        keys = list(keys)
        found = self._exists_native(keys) if self._one_call and keys else None
        return found if found is not None else list(self._rpc.call("exists", keys))

    def _exists_native(self, keys: list[str]) -> list[bool] | None:
        """batch_exists in one native exchange; None where the Python path answers (a key that is not a str, an
        answer it could not merge, an HA leader that did not answer). Raises as RawRpcClient.call raises."""
        try:
            with self._rpc.held("exists") as h:
                try:
                    flags, [answer] = native.shard_exists([h.fd], [h.rid], keys, np.zeros(len(keys), np.uint32), h.ms)
                except TypeError:
                    return None
                if isinstance(answer, Exception):
                    raise h.failed(answer)
                if answer is not True:
                    h.payload(answer)  # raises the master's refusal
                    return None
        except MasterUnreachable:
            if self._ha:
                return None
            raise
        return (flags == 1).tolist()

    def batch_exists_prefix(self, keys: list[str]) -> int:
        """How many consecutive keys from the start are stored; one RPC."""
        return int(self._rpc.call("exists_prefix", list(keys)))

    def remove(self, key: str) -> None:
        """Remove ``key``. Raises KeyNotFound. A reader holding a lease keeps valid bytes until it ends."""
        _raise_first(self.batch_remove([key]))

    def batch_remove(self, keys: list[str]) -> list[StoreError | None]:
        keys = list(keys)
        return [
            None if c == protocol.OK else KeyNotFound(k) for k, (c, _) in zip(keys, self._rpc_entries("remove", keys))
        ]

    def flush(self) -> None:
        """Wait until the master has answered every pipelined put_commit of this client (then every other
        client sees those objects). Raises MasterUnreachable. close() flushes too."""
        self._rpc.flush()

    @property
    def segment_name(self) -> str | None:
        """The name of the segment this client contributes (``segment_size`` > 0), as the master lists it and
        as ``preferred_segment`` takes it; None without one (or once the master drained it)."""
        segment = self._segment
        return segment.name if segment is not None else None

    def stats(self) -> dict:
        """hits, misses, puts, gets, bytes_put, bytes_got, checksum_errors (replica reads that failed their
        checksum), corrupt_reported, lease_rereads (entries read again: their read ended after its lease),
        put/get latency p50/p99 (µs), own segment name."""
        return {**self._stats.snapshot(), "master": self.master, "segment": self.segment_name}

    def transfer_stats(self) -> dict:
        """The transfer engine's counters: entries and bytes per transport (shm, cma, rdma, tcp), fallbacks between
        them, errors by type, and the RDMA transport's own (work requests, path failures, QP rebuilds)."""
        return self._engine.stats()

    def close(self) -> None:
        """Unregister the own segment (if any), free the staging buffer, stop the engine. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._rpc.flush()
        except MasterUnreachable as e:
            log.warning("close: pipelined commits not confirmed: %s", e)
        if self._slabs is not None:
            self._slabs.close()
        if self._segment_link is not None:
            self._segment_link.close()  # (its thread ends first: a drain's end cannot race the lines below)
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        if self._segment_rpc is not None:
            self._segment_rpc.close()
        if self._admin_rpc is not None:
            self._admin_rpc.close()
        self._staging.close()
        self._engine.close()
        self._rpc.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def master_call(self, op: str, entries: list, opts: dict | None = None):
        """Run one master op (store/master; e.g. the compat layer's get_size, remove_by_regex, task_create) as
        the role it needs (security/roles.py): admin ops on an admin connection opened on first use, the rest on
        this client's connection. Returns the op's payload. Raises Forbidden (this process's credential lacks
        the role), MasterUnreachable, StoreError (the master refused the request)."""
        if roles.needed(op) != "admin":
            return self._rpc.call(op, entries, opts)
        with self._admin_lock:
            if self._admin_rpc is None:
                self._admin_rpc = master_client(self.master, self.cfg.rpc_timeout_ms, "admin")
            return self._admin_rpc.call(op, entries, opts)

    # ---- byte ranges of objects at known locations (Mooncake's put and get sessions: mooncake/sessions.py) ----
    # A put session reserves objects (put_start: pending, allocated), writes ranges of them at offsets the caller
    # picks (transfer_ranges "write"), then commits them (put_commit, no checksum: the client never holds the
    # whole object) or aborts them; a get session looks objects up once (locate, with a lease) and reads ranges
    # of them (transfer_ranges "read"). Every transfer is one array-form batch per (segment, region).
    def put_start(self, keys: list[str], sizes: list[int], config: PutConfig | None = None) -> list:
        """Reserve ``keys`` of ``sizes`` bytes: per key (code, the replicas' list of Location where code is OK,
        else why) (store/wire/protocol.py codes; EXISTS for a stored key). Raises MasterUnreachable, StoreError
        for a malformed answer."""
        cfg, sent = config or self._put_cfg, time.monotonic()
        started = self._rpc_entries("put_start", [[k, int(n)] for k, n in zip(keys, sizes)], cfg.wire)
        deadline = self._write_deadline(sent)
        for k, (code, _) in zip(keys, started):
            if code == protocol.OK and deadline is not None:
                self._grants[k] = deadline
        if len(self._grants) > self._prune_grants_at:  # sessions never ended: their grants are expired by now
            now = time.monotonic()
            self._grants = {k: d for k, d in self._grants.items() if d > now}
            self._prune_grants_at = max(GRANTS_PRUNED_PAST, 2 * len(self._grants))
        return [(code, replies.locations(value) if code == protocol.OK else value) for code, value in started]

    def put_commit(self, keys: list[str]) -> list:
        """Make reserved ``keys`` readable, without checksums: per key [code, detail]."""
        for k in keys:
            self._grants.pop(k, None)
        return self._rpc_entries("put_commit", list(keys), {"xxh3": [None] * len(keys)})

    def put_abort(self, keys: list[str]) -> list:
        """Drop reserved ``keys``: per key [code, detail]."""
        for k in keys:
            self._grants.pop(k, None)
        return self._rpc_entries("put_abort", list(keys))

    def locate(self, keys: list[str]) -> list:
        """Where ``keys`` are, with a read lease: per key (code, a replies.Found where code is OK, else why)
        (disk-only objects promoted first). Raises MasterUnreachable, StoreError for a malformed answer."""
        return self._lookup(list(keys))

    def transfer_ranges(
        self,
        kind: str,
        keys: list[str],
        spans: list[list[Span]],
        offsets: list[list[int]],
        locations: dict[int, list[Location]],
        lease_end: float | None = None,
    ) -> list[StoreError | None]:
        """Write (``kind`` "write") or read each key's spans (address, bytes) at ``offsets`` (bytes) inside the
        object, at ``locations[i]`` (every replica for a write, the first for a read). ``lease_end`` (a read;
        monotonic s): when the read lease of the lookup that gave ``locations`` ends; entries whose read ends
        after it are looked up and read again under a new lease (LEASE_ROUNDS rounds), then fail with
        LeaseExpired. Per key None or the error (a span outside registered memory: BufferNotRegistered; a failed
        transfer: TransferFailed; a key gone or shrunk by the new lookup: KeyNotFound, SizeMismatch)."""
        out = self._ranges_once(kind, keys, spans, offsets, locations, lease_end)
        if kind == "read" and lease_end is not None:
            self._again_while_late(out, lambda late: self._ranges_looked_up(keys, spans, offsets, late))
        return out

    def _ranges_looked_up(self, keys, spans, offsets, late: list[int]) -> list[StoreError | None]:
        """The range reads of entries ``late``, at the locations of a new lookup (a new lease)."""
        t0, found = time.monotonic(), self._lookup([keys[i] for i in late])
        out: list[StoreError | None] = [None] * len(late)
        locs = {}
        for j, (i, (code, value)) in enumerate(zip(late, found)):
            if code != protocol.OK:
                out[j] = KeyNotFound(keys[i])
            elif any(o + n > value.size for o, (_, n) in zip(offsets[i], spans[i])):
                out[j] = SizeMismatch(f"{keys[i]}: now {value.size} bytes, shorter than the ranges asked")
            else:
                locs[j] = value.replicas
        ttl = min((found[j][1].lease_ttl_ms for j in locs), default=0)
        sub = [keys[i] for i in late], [spans[i] for i in late], [offsets[i] for i in late]
        for j, err in enumerate(self._ranges_once("read", *sub, locs, t0 + ttl / 1000)):
            if j in locs:
                out[j] = err
        return out

    def _ranges_once(self, kind, keys, spans, offsets, locations, lease_end) -> list[StoreError | None]:
        """transfer_ranges without the reads again."""
        out: list[StoreError | None] = [None] * len(keys)
        flat = batches.arrays(batches.flatten(self._engine, keys, spans, out))
        flat.inner = np.fromiter((o for offs in offsets for o in offs), dtype=np.uint64, count=len(flat.lens))
        todo = {i: locs if kind == "write" else locs[:1] for i, locs in locations.items() if out[i] is None}
        failed: dict[int, StoreError] = {}
        descs = self._descriptors({loc.segment for locs in todo.values() for loc in locs})
        deadline = None
        if kind == "write" and self._put_ttl_s is not None:  # every put_start left a grant (pruned once expired)
            for i in [i for i in todo if keys[i] not in self._grants]:
                del todo[i]
                failed[i] = TransferFailed(
                    f"{keys[i]}: no write grant held (its put_start expired, or this client made none): put_start again"
                )
            deadline = min((self._grants[keys[i]] for i in todo), default=None)
        stale_at = lease_end if kind == "read" else None
        self._run_groups(kind, flat, batches.groups(flat, todo, descs, failed), failed, None, deadline, stale_at)
        for i, err in failed.items():
            out[i] = err
        return out

    # ---- internals -----------------------------------------------------------------------------------
    def _rpc_entries(self, op: str, entries: list, opts: dict | None = None) -> list:
        return self._rpc.call(op, entries, opts) if entries else []

    def _write(self, keys, spans_per_key, config: PutConfig) -> tuple[list[StoreError | None], list[int]]:
        """(per-key None or error, bytes per key)."""
        done = self._write_native(keys, spans_per_key, config)
        if done is not None:
            return done
        out: list[StoreError | None] = [None] * len(keys)
        flat = batches.flatten(self._engine, keys, spans_per_key, out)
        batches.reject_empty(keys, flat, out)
        todo = [i for i, e in enumerate(out) if e is None]
        slabs = self._slabs
        if todo and slabs is not None and _slab_placed(config) and slabs.lock.acquire(blocking=False):
            try:
                todo = self._write_slab(keys, flat, todo, out)
            finally:
                slabs.lock.release()
        pending = self._start_and_write(keys, flat, todo, out, config)
        if pending:
            self._wait_pending(keys, flat, pending, out, config)
        return out, flat.sizes

    def _start_and_write(self, keys, flat, todo: list[int], out, config: PutConfig) -> list[int]:
        """put_start for keys ``todo``, the transfer and the commit; sets ``out[i]`` for failed keys. Returns
        the keys another writer's uncommitted put holds (PENDING): nothing was written for them."""
        if not todo:
            return []
        sent = time.monotonic()
        started = self._rpc_entries("put_start", [[keys[i], flat.sizes[i]] for i in todo], config.wire)
        writes, pending = {}, []
        for i, (code, value) in zip(todo, started):
            if code == protocol.OK:
                writes[i] = replies.locations(value)
            elif code == protocol.PENDING:
                pending.append(i)
            elif code != protocol.EXISTS:
                out[i] = protocol.entry_error(code, keys[i], value)
        if writes:
            sums = checksum.span_sums(flat)
            failed = self._transfer("write", flat, writes, sums, self._write_deadline(sent))
            self._finish_puts(keys, writes, failed, out, checksum.digests(flat, writes, sums))
        return pending

    def _wait_pending(self, keys, flat, pending: list[int], out, config: PutConfig) -> None:
        """Keys another writer is putting: put_start again, backing off from 1 to 50 ms, until that put commits
        (EXISTS: stored, nothing to do), aborts or is reclaimed (OK: written here). After ``pending_wait_ms``
        the rest get PutPending: a put never reports "stored" for bytes that did not land (issue #18)."""
        deadline, delay = time.monotonic() + self.cfg.pending_wait_ms / 1000, 0.001
        while pending:
            if time.monotonic() + delay > deadline:
                for i in pending:
                    out[i] = PutPending(
                        f"{keys[i]}: another writer's put of this key has not committed within "
                        f"pending_wait_ms={self.cfg.pending_wait_ms} ms; this put stored nothing: "
                        "retry later"
                    )
                return
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
            pending = self._start_and_write(keys, flat, pending, out, config)

    def _write_native(self, keys, spans_per_key, config: PutConfig) -> tuple[list, list[int]] | None:
        """A whole batch's slab put in one native call, its spans checked and flattened in one native pass
        (engine.registered_spans): _write's result, or None where it does not apply (no one-call ops, no slab, a
        span outside registered memory, an empty object, over NATIVE_MAX_BYTES, the slab busy or full, the slab's
        region neither mapped nor routed over TCP yet, a failed TCP write): then the general path puts the batch."""
        slabs = self._slabs
        if self._one_call_maps is None or slabs is None or not keys or len(keys) != len(spans_per_key):
            return None
        spans = self._engine.registered_spans(spans_per_key) if _slab_placed(config) else None
        if spans is None or spans[4] > NATIVE_MAX_BYTES or min(spans[3]) <= 0:
            return None
        if not slabs.lock.acquire(blocking=False):
            return None
        try:
            placed = slabs.place(spans[3])
            one = self._put_native(keys, spans[:3], *placed) if placed is not None else None
            if one is None:
                return None
            out: list[StoreError | None] = [None] * len(keys)
            again = self._slab_answered(keys, placed[0], *one, list(range(len(keys))), {}, out)
        finally:
            slabs.lock.release()
        if again:  # EXPIRED or PENDING: put_start for those (rare: the general path's flatten for them)
            flat = batches.flatten(self._engine, keys, spans_per_key, out)
            pending = self._start_and_write(keys, flat, again, out, config)
            if pending:
                self._wait_pending(keys, flat, pending, out, config)
        return out, spans[3]

    def _write_slab(self, keys, flat, todo: list[int], out) -> list[int]:
        """One round trip: write keys ``todo`` into this client's reserved slab, then one ``put`` RPC
        (slab.py). Sets ``out[i]`` for refused keys; returns the keys to put with put_start instead (no
        slab space for the batch, the write into the slab failed, or the master no longer knew the slab)."""
        placed = self._slabs.place([flat.sizes[i] for i in todo])
        if placed is None:
            return todo
        slab, offsets = placed
        one = None
        if self._one_call_maps is not None and sum(flat.sizes[i] for i in todo) <= NATIVE_MAX_BYTES:
            one = self._put_native([keys[i] for i in todo], _todo_columns(flat, todo), slab, offsets)
        if one is not None:
            return self._slab_answered(keys, slab, *one, todo, {}, out)
        writes = {i: [Location(slab.segment, slab.region_id, off)] for i, off in zip(todo, list(map(int, offsets)))}
        sums = checksum.span_sums(flat)
        failed = self._transfer("write", flat, writes, sums, slab.expires - self.cfg.rpc_timeout_ms / 1000)
        if failed:
            self._slabs.forget()  # e.g. the segment is gone: do not write there again
        ok = [i for i in todo if i not in failed]
        if not ok:
            return list(failed)
        digests, sent = checksum.digests(flat, ok, sums), time.monotonic()
        try:
            answers = self._rpc.call(
                "put",
                [[keys[i], flat.sizes[i], slab.id, writes[i][0].offset] for i in ok],
                {"xxh3": [digests[i] for i in ok]},
            )
        except StoreError:
            self._slabs.forget()
            raise
        return self._slab_answered(keys, slab, sent, answers, ok, failed, out)

    def _slab_answered(self, keys, slab, sent: float, answers: list, ok: list[int], failed: dict, out) -> list[int]:
        """The master's answers to a ``put`` into ``slab`` sent at monotonic ``sent``, one per key of ``ok`` (None:
        every one OK or EXISTS): sets ``out[i]`` for refused keys; returns the keys to put with put_start instead
        (``failed``: their writes failed; EXPIRED: the master no longer knew the slab; PENDING: another writer's
        put, put_start waits)."""
        self._slabs.renewed(slab, sent)
        again, pending = list(failed), []
        for i, (code, value) in zip(ok, answers or ()):
            if code == protocol.OK or code == protocol.EXISTS:
                continue
            if code == protocol.EXPIRED:
                again.append(i)
            elif code == protocol.PENDING:
                pending.append(i)
            else:
                out[i] = protocol.entry_error(code, keys[i], value)
        if again:
            self._slabs.forget()
        return again + pending

    def _put_native(self, keys: list[str], cols: tuple, slab, offsets) -> tuple[float, list] | None:
        """The slab write and ``put`` of ``keys`` (their spans' addresses, lengths and per-key starts: ``cols``)
        in one native call (native.put_many) when the slab's region is mapped here, or a native write over TCP
        (native.write_tcp, fenced as _run_groups fences) and then that call: (monotonic time before it, the put's
        answers, None when every one is OK or EXISTS). None when nothing was written or sent, or when an HA
        master's leader did not answer (the caller puts again through the general path: puts are idempotent by
        key). ``offsets``: each key's place in the slab (an int list or uint64 array: SlabSpace.place)."""
        sent = time.monotonic()
        write_ms = (slab.expires - self.cfg.rpc_timeout_ms / 1000 - sent) * 1000  # as _transfer's deadline
        written = None
        if slab.segment in self._tcp_routed and write_ms > 0:  # a slab reached over TCP: written before the RPC
            timeout_ms = min(float(self.cfg.transfer_timeout_ms), write_ms)
            land_by = int(time.time() * 1000 + timeout_ms)
            written = native.write_tcp(
                self._tcp_peers, *cols, slab.segment, slab.region_id, offsets, timeout_ms, land_by
            )
            if written == []:  # a frame failed (the node may be gone or stalled): no slab write there again
                self._slabs.forget()
                return None
        if written is None and self._shm_maps is None:
            return None
        try:
            with self._rpc.held("put") as h:
                try:
                    got = native.put_many(
                        h.fd, h.rid, keys, *cols, (slab.segment, slab.region_id, slab.id), offsets, write_ms, h.ms,
                        self._one_call_maps, written,
                    )  # fmt: skip
                except (OSError, TimeoutError) as e:
                    raise h.failed(e) from e
                except TypeError:  # a key that is not a str
                    return None
                if got is None:
                    return None
                body = got[1]  # None: every answer OK or EXISTS
                return sent, h.payload(body) if body is not None else None
        except StoreError as e:
            self._slabs.forget()
            if self._ha and isinstance(e, MasterUnreachable):
                return None  # the leader changed: put again through the general path (idempotent by key)
            raise

    def _finish_puts(self, keys, writes, failed: dict, out, sums: dict) -> None:
        ok = [i for i in writes if i not in failed]
        opts = {"xxh3": [sums[i] for i in ok]}
        if ok and not self.cfg.wait_commit:
            committed = [keys[i] for i in ok]
            self._rpc.send_deferred(
                "put_commit",
                committed,
                opts,
                on_reply=lambda good, payload: self._commit_replied(committed, good, payload),
            )
            ok = []
        for i, (code, value) in zip(ok, self._rpc_entries("put_commit", [keys[i] for i in ok], opts)):
            if code != protocol.OK:
                out[i] = TransferFailed(f"{keys[i]}: put not committed: {value}")
        if failed:
            self._rpc_entries("put_abort", [keys[i] for i in failed])
            for i, err in failed.items():
                out[i] = err

    def _commit_replied(self, keys: list[str], ok: bool, payload) -> None:
        """The reply of a pipelined put_commit: a key the master did not commit is a miss from now on."""
        bad = (
            [k for k, (code, _) in zip(keys, payload) if code != protocol.OK]
            if ok and isinstance(payload, list)
            else list(keys)
        )
        if bad:
            self._stats.commit_failed(len(bad))
            log.warning(
                "%d pipelined put_commit(s) failed (%s...): %s; those keys read as misses",
                len(bad),
                bad[0],
                payload if not ok else "expired",
            )

    def _read(self, keys, spans_per_key, found=None, t0=None) -> tuple[list[StoreError | None], list[int]]:
        """(per-key None or error, bytes per key). ``found``/``t0``: the get RPC's answer and the monotonic time
        just before it, if already asked."""
        t0 = time.monotonic() if t0 is None else t0
        out: list[StoreError | None] = [None] * len(keys)
        found = self._lookup(keys, found)
        flat = batches.flatten(self._engine, keys, spans_per_key, out)
        reads = {}
        for i, (code, value) in enumerate(found):
            if out[i] is not None:
                continue
            if code != protocol.OK:
                out[i] = KeyNotFound(keys[i])
            elif flat.sizes[i] != value.size:
                out[i] = SizeMismatch(
                    f"{keys[i]}: object is {value.size} bytes, spans hold "
                    f"{flat.sizes[i]}; pass spans summing to {value.size}"
                )
            else:
                reads[i] = value
        ttl = min((v.lease_ttl_ms for v in reads.values()), default=0)
        failed, corrupt, first = self._read_replicas(reads, flat, keys, t0 + ttl / 1000)
        for i, err in failed.items():
            out[i] = err
        self._report_corrupt(corrupt, first)
        return out, flat.sizes

    def _read_late_again(self, keys: list[str], spans_per_key: list, out: list) -> None:
        """Read again the entries of ``out`` that failed with LeaseExpired (the last transfer groups of a big
        batch on a loaded host end after a short lease), each round a new lookup and lease."""
        self._again_while_late(
            out, lambda late: self._read([keys[i] for i in late], [spans_per_key[i] for i in late])[0]
        )

    def _again_while_late(self, out: list, reread) -> None:
        """Up to LEASE_ROUNDS rounds: the entries of ``out`` that failed with LeaseExpired take the answers of
        ``reread(their indices)`` (read under a new lease). Updates ``out`` in place."""
        for _ in range(LEASE_ROUNDS):
            late = [i for i, e in enumerate(out) if isinstance(e, LeaseExpired)]
            if not late:
                return
            self._stats.lease_reread(len(late))
            for i, err in zip(late, reread(late)):
                out[i] = err

    def _read_cols(self, keys, spans_per_key) -> tuple[list[StoreError | None], list[int]]:
        """_read for a big batch: the master answers in columns and the spans are planned with numpy (no
        per-key Python objects). Objects with several replicas take the general path."""
        t0 = time.monotonic()
        out: list[StoreError | None] = [None] * len(keys)
        cols = self._rpc.call("get", keys, {"cols": 1})
        ttl, sizes, names, regions, seg_idx, offs, more, sums, disk = cols
        if more or disk:
            return self._read(keys, spans_per_key, self._cols_found(cols), t0)
        flat = batches.arrays(batches.flatten(self._engine, keys, spans_per_key, out))
        got, want = np.array(sizes, dtype=np.int64), np.array(flat.sizes, dtype=np.int64)
        for i in np.flatnonzero(got != want).tolist():
            if out[i] is None:
                out[i] = (
                    KeyNotFound(keys[i])
                    if got[i] < 0
                    else SizeMismatch(
                        f"{keys[i]}: object is {got[i]} bytes, spans hold {want[i]}; pass spans summing to {got[i]}"
                    )
                )
        ok = np.array([e is None for e in out], dtype=bool)
        failed: dict[int, StoreError] = {}
        groups = batches.col_groups(
            flat, ok, (names, regions, np.array(seg_idx), np.array(offs)), self._descriptors(set(names)), failed
        )
        span_sums = checksum.span_sums(flat) if self.cfg.verify_checksums else None
        for i, err in self._run_groups("read", flat, groups, failed, span_sums, stale_at=t0 + ttl / 1000).items():
            out[i] = err
        corrupt, idx = [], np.flatnonzero(ok).tolist()
        if self.cfg.verify_checksums:
            read = {i: sums[i] for i in idx if out[i] is None}
            bad = checksum.mismatched(flat, read, span_sums)
            for i in bad:
                out[i] = ChecksumMismatch(f"{keys[i]}: bytes read do not match the object's checksum")
            corrupt = [[keys[i], names[seg_idx[i]], offs[i], sums[i]] for i in bad]
        self._report_corrupt(corrupt, checksum.head(flat, bad[0]) if corrupt else "")
        return out, flat.sizes

    @staticmethod
    def _cols_found(cols) -> list:
        """Per key of a column-form get answer (master/service.py op_get), its per-entry form: [code, Found or
        the value]."""
        ttl, sizes, names, regions, seg_idx, offs, more, sums, disk = cols
        return [
            disk.get(j, [protocol.NOT_FOUND, None])
            if n < 0
            else [
                protocol.OK,
                Found(
                    n,
                    replies.locations(more[j]) if more.get(j) else [Location(names[k], regions[k], off)],
                    ttl,
                    sums[j],
                ),
            ]
            for j, (n, k, off) in enumerate(zip(sizes, seg_idx, offs))
        ]

    def _read_replicas(
        self, reads: dict[int, Found], flat, keys, stale_at: float
    ) -> tuple[dict[int, StoreError], list, str]:
        """Read each object from its first replica; entries that failed (transfer error or checksum mismatch)
        retry on the next replica, one transfer batch per round; those past their lease (monotonic ``stale_at``)
        do not. Returns (index -> error of the entries no replica could serve, the mismatched replicas as
        report_corrupt entries, the first mismatched read's leading bytes in hex (checksum.head) or '')."""
        failed: dict[int, StoreError] = {}
        pending, corrupt, first = dict(reads), [], ""
        for r in range(max((len(v.replicas) for v in reads.values()), default=0)):
            attempt = {i: v.replicas[r : r + 1] for i, v in pending.items() if r < len(v.replicas)}
            if not attempt:
                break
            sums = checksum.span_sums(flat) if self.cfg.verify_checksums else None
            errors = self._transfer("read", flat, attempt, sums, stale_at=stale_at)
            if self.cfg.verify_checksums:
                done = {i: reads[i].checksum for i in attempt if i not in errors}
                for i in checksum.mismatched(flat, done, sums):
                    errors[i] = ChecksumMismatch(f"{keys[i]}: bytes read do not match the object's checksum")
                    first = first or checksum.head(flat, i)
                    loc = attempt[i][0]
                    corrupt.append([keys[i], loc.segment, loc.offset, reads[i].checksum])
            for i in attempt:
                failed.pop(i, None)
            failed.update(errors)
            pending = {i: reads[i] for i, e in errors.items() if not isinstance(e, LeaseExpired)}
        return failed, corrupt, first

    def _report_corrupt(self, entries: list, first: str = "") -> None:
        """Tell the master which replicas ([key, segment, offset, checksum]) failed their checksum; the warning
        names the first and the leading bytes read for it (``first``, hex)."""
        if not entries:
            return
        try:
            reported = sum(code == protocol.OK for code, _ in self._rpc.call("report_corrupt", entries))
        except StoreError as e:
            log.warning("report_corrupt of %d replicas failed: %s", len(entries), e)
            reported = 0
        log.warning(
            "%d replica read(s) failed their checksum (first: %s on %s at %s, read bytes start %s)",
            len(entries),
            entries[0][0],
            entries[0][1],
            entries[0][2],
            first or "?",
        )
        self._stats.checksum_failed(len(entries), reported)

    def _lookup(self, keys: list[str], found: list | None = None) -> list:
        """The get answer for ``keys`` (asked now unless ``found`` is given) as (code, Found or why) per key,
        disk-resident entries (ON_DISK) promoted by the disk tier's client side
        (kvplugins.store.client.promote.resolve) or, without it, misses. Raises StoreError for a malformed one."""
        found = self._rpc_entries("get", keys) if found is None else found
        if any(code == protocol.ON_DISK for code, _ in found):
            found = promote.resolve(self, keys, found)
        return [(code, replies.found(value) if code == protocol.OK else value) for code, value in found]

    def _transfer(
        self, kind: str, flat, todo: dict, sums, deadline: float | None = None, stale_at: float | None = None
    ) -> dict[int, StoreError]:
        """One array-form transfer per (segment, region) for keys ``todo`` (index -> locations to use); each
        moved span's xxh3_64 goes to ``sums`` (checksum.span_sums). ``deadline``, ``stale_at``: as
        _run_groups. Returns index -> error."""
        failed: dict[int, StoreError] = {}
        descs = self._descriptors({loc.segment for locs in todo.values() for loc in locs})
        groups = batches.groups(flat, todo, descs, failed)
        return self._run_groups(kind, flat, groups, failed, sums, deadline, stale_at)

    def _write_deadline(self, sent: float) -> float | None:
        """When a write into space granted by a put_start sent at monotonic ``sent`` must have ended: the
        master reclaims the space put_timeout_ms after it, and may hand it to another put; less a margin for
        bytes on the wire and the commit (the RPC timeout, at most a quarter of put_timeout_ms). None when the
        master did not say its put_timeout_ms."""
        ttl = self._put_ttl_s
        return None if ttl is None else sent + ttl - min(self.cfg.rpc_timeout_ms / 1000, ttl / 4)

    def _run_groups(
        self,
        kind: str,
        flat,
        groups: list,
        failed: dict,
        sums,
        deadline: float | None = None,
        stale_at: float | None = None,
    ) -> dict[int, StoreError]:
        """Run each (descriptor, region id, span indices, remote offsets) group, the xxh3_64 of each span it
        moves into ``sums[span index]`` (unless ``sums`` is None); adds index -> error to ``failed``.
        ``deadline`` (monotonic s): a write into granted space ends by then, or is not started: a client paused
        (SIGSTOP) or slowed past it must not land bytes in space the master has reclaimed for another object.
        ``stale_at`` (monotonic s): the end of a read's lease; a group that ends after it (or would start
        after it) fails its entries with LeaseExpired, since the space may hold another object by then."""
        fn = self._engine.write_spans if kind == "write" else self._engine.read_spans
        for desc, region_id, sel, roffs in groups:
            if stale_at is not None and time.monotonic() > stale_at:
                _fail_late(flat, sel, failed, stale_at)
                continue
            addrs, lens = batches.pick(flat.addrs, sel), batches.pick(flat.lens, sel)
            got = None if sums is None else np.zeros(len(sel), dtype=np.uint64)
            timeout_ms = float(self.cfg.transfer_timeout_ms)
            if deadline is not None:
                timeout_ms = min(timeout_ms, (deadline - time.monotonic()) * 1000)
            try:
                if timeout_ms <= 0:
                    raise TransferFailed(
                        f"not sent: the space granted for it was due back to the master {-timeout_ms:.0f} ms "
                        "ago (put_timeout_ms); this client was paused or its transfers were slow: put again"
                    )
                fence = {"fenced": True} if deadline is not None else {}  # a write: the peer drops it once late
                statuses = fn(desc, region_id, addrs, roffs, lens, timeout_ms=timeout_ms, digests=got, **fence)
                if sums is not None:
                    sums[sel] = got
            except (TransferError, NativeError) as e:  # the whole batch failed
                statuses = [e] * len(sel)
            for j, err in enumerate(statuses):
                if err is not None:
                    idx = int(flat.owner[sel[j]])  # sel: a list or an index array
                    failed.setdefault(idx, TransferFailed(f"{kind} of entry {idx} failed: {err}"))
            if stale_at is not None and time.monotonic() > stale_at:
                _fail_late(flat, sel, failed, stale_at)
        return failed

    def _descriptors(self, names: set[str]) -> dict:
        missing = [n for n in names if n not in self._descs]
        for name, (code, wire) in zip(missing, self._rpc_entries("describe", missing)):
            if code == protocol.OK:
                desc = self._descs[name] = SegmentDescriptor.from_wire(wire)
                if self._shm_maps is not None:
                    self._shm_maps.alias(name, desc.segment_id)
                if self._tcp_peers is not None and self._engine.route_natively(name, desc):
                    self._tcp_routed.add(name)
        return self._descs


def _todo_columns(flat, todo: list[int]) -> tuple:
    """(addresses, lengths, per-key starts) of the spans of keys ``todo`` (sorted key indices) of ``flat``."""
    addrs, lens, owner = flat.addrs, flat.lens, flat.owner
    if type(owner) is list:  # a small batch: no numpy
        if len(todo) != flat.nkeys:
            pos = {k: j for j, k in enumerate(todo)}
            picked = [j for j, o in enumerate(owner) if o in pos]
            addrs, lens, owner = [addrs[j] for j in picked], [lens[j] for j in picked], [pos[owner[j]] for j in picked]
        return addrs, lens, [bisect.bisect_left(owner, k) for k in range(len(todo) + 1)]
    if len(todo) != flat.nkeys:
        sel = np.isin(owner, todo)
        addrs, lens, owner = addrs[sel], lens[sel], np.searchsorted(todo, owner[sel])
    return addrs, lens, np.searchsorted(owner, np.arange(len(todo) + 1))


def _slab_placed(config: PutConfig) -> bool:
    """Whether a put with ``config`` may go to the client's slab: one replica, no preferred segment, no pin."""
    return config.replicas == 1 and not config.preferred_segment and config.pin == "none"


def _put_ttl_s(info) -> float | None:
    """The master's put_timeout_ms (its ``info`` answer) in seconds; None where it does not say."""
    ttl = info.get("put_timeout_ms") if isinstance(info, dict) else None
    return ttl / 1000 if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > 0 else None


def _fail_late(flat, sel, failed: dict, stale_at: float) -> None:
    """Fail the entries of spans ``sel`` not failed yet with LeaseExpired (their read ends past ``stale_at``)."""
    late = LeaseExpired(
        f"read ended {1000 * (time.monotonic() - stale_at):.0f} ms after its lease (lease_ttl_ms): "
        "its bytes may be stale, so they are not used"
    )
    for j in range(len(sel)):
        failed.setdefault(int(flat.owner[sel[j]]), late)


def _raise_first(errors) -> None:
    for e in errors:
        if e is not None:
            raise e


def _command_link(cfg: ClientConfig, engine, segment, master: str, on_exit):
    """The command link of a client's own segment (a store node's NodeTier, without a disk): replica copy/move
    tasks whose source is this segment (master/replica_tasks.py) and a drain of it run through it, polled every
    ``segment_poll_ms``. A drain's end calls ``on_exit`` (the client unregisters the segment and goes on)."""
    node = StoreNodeConfig(
        master=master,
        segment_size=cfg.segment_size,
        host=cfg.host,
        rpc_timeout_ms=cfg.rpc_timeout_ms,
        disk_poll_ms=cfg.segment_poll_ms,
        prefault=False,
    )
    return NodeTier(node, engine, segment, master, on_exit=on_exit)
