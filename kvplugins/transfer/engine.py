"""TransferEngine: one per process. Registers memory, publishes a SegmentDescriptor, runs batches.

See kvplugins/transfer/api.py for the lifecycle. Routing and fallback between transports: routing.py.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import socket
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvplugins import native
from kvplugins.errors import ConfigError, OutOfRange, TransferError, TransferFailed
from kvplugins.transfer import cma, shmem
from kvplugins.transfer.api import DeviceMemory, Region, RegionInfo, SegmentDescriptor, TransferRequest
from kvplugins.transfer.config import TransferConfig
from kvplugins.transfer.memory import RegionTable, buffer_span, view_of
from kvplugins.transfer.rdma import RdmaTransport
from kvplugins.transfer.routing import Router, one_region, refused_write
from kvplugins.transfer.shm import ShmTransport
from kvplugins.transfer.spans import SMALL, as_u64
from kvplugins.transfer.tcp import TcpTransport
from kvplugins.transfer.transport import Deadline, Op, Transport

log = logging.getLogger("kvplugins.transfer")
_ABSENT_LOGGED: set[str] = set()  # reasons "rdma transport absent" was logged for (at INFO once, then DEBUG)


class TransferEngine:
    """Moves bytes between this process's registered memory and peers' exported regions.

    Thread-safe. Raises ConfigError for a bad config and OSError if the TCP port cannot be bound.
    """

    def __init__(self, config: TransferConfig | None = None):
        self.config = config or TransferConfig()
        self.host_id = shmem.host_id()
        self.segment_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._regions = RegionTable()
        self._transports = self._start_transports()
        self._router = Router(self._transports, self._regions)
        self._fast = self._fast_tables()  # small batches: one native call
        self._fast_fenced = tuple(f for f in self._fast if not isinstance(f[0], TcpTransport))  # tcp: the frame's fence
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="kvp-transfer")
        self._closed = False
        _OPEN.add(self)

    def _fast_tables(self) -> tuple:
        """(transport, native route table) of the transports whose small batches run natively from this API's
        entry: rdma's (rdma_fast.py) when it is the first transport, then cma's and tcp's (cma_fast.py,
        tcp_fast.py) in the configured order. Each table holds only routes its transport learnt as the router's first
        choice, so the order never changes a region's transport."""
        first = self._transports[0] if self._transports else None
        rdma = [(first, first.fast.native)] if isinstance(first, RdmaTransport) else []
        rest = [(t, t.fast.native) for t in self._transports if isinstance(t, (cma.CmaTransport, TcpTransport))]
        return tuple(rdma + rest)

    def _start_transports(self) -> list[Transport]:
        """The configured transports in preference order; cma only where the kernel has process_vm_readv, rdma
        only where probing finds a usable NIC (else one log line says why and routing is unchanged). TCP starts
        first: rdma sets up over its server."""
        names = self.config.transport_list()
        started: dict[str, Transport] = {}
        if "tcp" in names:
            started["tcp"] = TcpTransport(self.config, self._regions)
        if "shm" in names:
            started["shm"] = ShmTransport(self.host_id, self.config.copy_threads)
        if "cma" in names:
            if cma.available():
                started["cma"] = cma.CmaTransport(self.host_id)
        if "rdma" in names:
            rdma, why = RdmaTransport.probe(self.config, started["tcp"])
            if rdma is None:  # once per process: a replay starts an engine per capacity, a test dozens
                (log.info if why not in _ABSENT_LOGGED else log.debug)("rdma transport absent: %s", why)
                _ABSENT_LOGGED.add(why)
            else:
                started["rdma"] = rdma
        return [started[n] for n in names if n in started]

    # -- memory -------------------------------------------------------------------------------------
    def register(
        self,
        mem: Any,
        length: int | None = None,
        export: bool = False,
        peer_readonly: bool = False,
        device: DeviceMemory | None = None,
    ) -> Region:
        """Register ``mem`` (C-contiguous numpy array, contiguous torch CPU tensor, memoryview/bytearray
        or other buffer, or an int address with ``length`` in bytes). The caller keeps int-addressed
        memory alive until unregister(). ``export=True`` lets peers read/write it (over TCP; shm needs
        alloc_shared memory). Read-only memory (bytes, a read-only array) gives Region.readonly: it may be
        a write source but never a read destination nor written by peers. ``peer_readonly``: peers may read an
        exported region but never write it (Region.peer_readonly).
        ``device``: ``mem`` is an int address of device memory (transfer/device.py; Region.device): peers reach it
        over TCP, staged by its copy functions; this engine's own batches take host memory only (stage first).
        Raises TypeError for unsupported memory, OutOfRange for a bad length."""
        if device is not None and not isinstance(mem, int):
            raise TypeError(f"register({type(mem).__name__}, device=...): device memory is passed as an int address")
        addr, nbytes, owner, readonly = buffer_span(mem, length)
        return self._added(self._regions.add(addr, nbytes, owner, None, export, readonly, peer_readonly, device))

    def alloc_shared(self, nbytes: int, export: bool = True, populate: bool = True) -> Region:
        """Allocate ``nbytes`` of zeroed memfd/POSIX-shm memory (config.shm_backend) and register it with
        Region.shm_path set; exported memfd memory is handed to same-host peers as an fd (transfer/fdpass.py), so
        they map it and copy with one memcpy (posix memory cannot be sealed: peers use TCP). ``populate``: commit every page
        now (shmem.populate; ~0.6 s per GiB here) so no copy into it pays page faults. Freed by unregister().
        Raises OutOfRange for nbytes < 1 and OSError if the kernel refuses the memory."""
        if not isinstance(nbytes, int) or nbytes < 1:
            raise OutOfRange(f"alloc_shared(nbytes={nbytes!r}): use a positive number of bytes")
        mapping = shmem.allocate(nbytes, self.config.shm_backend, populate)
        region = self._added(self._regions.add(mapping.addr, nbytes, mapping, mapping.path, export))
        for t in self._transports:
            t.share(region, mapping)  # the shm transport hands it to same-host peers as an fd
        return region

    def _added(self, region: Region) -> Region:
        for t in self._transports:
            t.add_region(region)
        return region

    def memoryview(self, region: Region) -> memoryview:
        """A 1-D byte view of local ``region`` (length ``region.length``), writable unless region.readonly.
        alloc_shared memory stays mapped while the view lives; other memory is the caller's to keep."""
        pin = self._regions.pin(region)
        if (
            isinstance(pin, np.ndarray)
            and pin.dtype == np.uint8
            and pin.ctypes.data == region.addr
            and pin.nbytes == region.length
        ):
            return memoryview(pin)  # e.g. alloc_shared memory: the view keeps the mapping alive
        view = view_of(region.addr, region.length)
        return view.toreadonly() if region.readonly else view

    def region_for(self, addr: int, length: int) -> Region:
        """The registered region containing [addr, addr+length). Raises BufferNotRegistered."""
        return self._regions.find(addr, length)

    def unregister(self, region: Region) -> None:
        """Forget ``region`` (alloc_shared memory is unmapped). Raises BufferNotRegistered if unknown. A no-op on a
        closed engine (close released every region: an owner closing after the engine was closed at exit)."""
        if self._closed:
            return
        owner = self._regions.remove(region)
        for t in self._transports:
            t.remove_region(region)
        if isinstance(owner, shmem.Mapping):
            owner.close()

    # -- descriptor ---------------------------------------------------------------------------------
    def descriptor(self) -> SegmentDescriptor:
        """This process's exported regions and transports (fastest first), to send to peers."""
        regions = []
        for r in self._regions.exported():
            info = RegionInfo(r.region_id, r.length, r.shm_path, readonly=not r.peers_write)
            for t in self._transports:
                info = t.region_info(r, info)
            regions.append(info)
        transports = {t.name: t.endpoint() for t in self._transports}
        return SegmentDescriptor(self.segment_id, self.host_id, transports, tuple(regions))

    # -- batches ------------------------------------------------------------------------------------
    def batch_write(self, reqs: list[TransferRequest], timeout_ms: float | None = None) -> list[TransferError | None]:
        """Copy each request's local bytes to its remote region. Returns one status per request: None,
        OutOfRange (outside a region / not exported) or TransferFailed (peer gone, timeout after
        ``timeout_ms``, default config.timeout_ms). Never raises for a per-entry failure; raises TypeError
        for a non-TransferRequest entry, ValueError for a bad timeout, TransferFailed if closed."""
        return self._fast_requests(False, reqs, timeout_ms) or self._router.run(
            Op.WRITE, reqs, self._timeout(timeout_ms)
        )

    def batch_read(self, reqs: list[TransferRequest], timeout_ms: float | None = None) -> list[TransferError | None]:
        """Copy each request's remote bytes into its local region; statuses as batch_write."""
        return self._fast_requests(True, reqs, timeout_ms) or self._router.run(Op.READ, reqs, self._timeout(timeout_ms))

    def _fast_requests(self, read: bool, reqs, timeout_ms) -> list[None] | None:
        """A small batch of requests to one remote region done by a native route table (write_spans), or None."""
        if not self._fast or not 0 < len(reqs) <= SMALL:
            return None
        one = one_region(reqs)
        return None if one is None else self._fast_spans(self._fast, read, one[0], one[1], *one[2], timeout_ms, None)

    def _fast_spans(self, fast, read: bool, remote, region, addrs, roffs, lens, timeout_ms, digests) -> list | None:
        """A small batch done by the first native route table of ``fast`` ((transport, table) pairs: rdma_fast.py,
        tcp_fast.py) that takes it, or None where none did or a batch failed there (the transport forgets that
        peer's routes and marks the path: the caller runs the batch its general way)."""
        for transport, table in fast:
            n = (table.read if read else table.write)(remote, region, addrs, roffs, lens, timeout_ms, digests)
            if n > 0:
                return [None] * n
            if n < 0:
                transport.fast_failed(remote.segment_id)
                return None
        return None

    def write_spans(
        self,
        remote: SegmentDescriptor,
        remote_region: int,
        local_addrs,
        remote_offsets,
        lengths,
        timeout_ms: float | None = None,
        digests=None,
        fenced: bool = False,
    ) -> list[TransferError | None]:
        """Array form of batch_write for one remote region: span j copies ``lengths[j]`` bytes from local
        address ``local_addrs[j]`` (inside any registered region) to offset ``remote_offsets[j]`` of region
        ``remote_region`` of ``remote``. The three are 1-D integer sequences/arrays of equal length (bytes;
        uint64-able). Spans contiguous on both sides are coalesced (kvplugins/transfer/spans.py). Returns
        one status per span as batch_write (OutOfRange for a span outside registered memory or the remote
        region). ``digests``: a writable uint64 numpy array of one entry per span, set to the xxh3_64
        (``xxhash.xxh3_64_intdigest``) of each span moved (the shm transport hashes in its copy pass; others
        are hashed from local memory after the move); spans are then not coalesced, and a failed span's entry
        is meaningless. ``fenced``: the bytes must land within ``timeout_ms`` or not at all, also at the peer:
        over TCP a frame reaching a peer (or read by it) after that fails with a "late write" TransferFailed
        and writes nothing more (hosts' clocks must agree: the check uses the peer's wall clock); other transports
        stop issuing then. Raises ValueError for arrays of different lengths, a bad ``digests`` or timeout,
        OutOfRange for negative values, TransferFailed if closed.
        A small batch to a region a small batch reached before over rdma (the first transport), cma or tcp (the
        router's first choice there) is checked, moved and hashed in one native call (rdma_fast.py, cma_fast.py,
        tcp_fast.py; not tcp when ``fenced``); anything else goes through the router (routing.py)."""
        fast = self._fast_fenced if fenced else self._fast  # rdma's fence is its deadline: nothing posted after it
        if fast and refused_write(remote, remote_region) is not None:
            fast = ()  # read-only to peers: the router refuses it (run_spans), nothing is posted
        done = fast and self._fast_spans(fast, False, remote, remote_region, local_addrs, remote_offsets, lengths,
                                         timeout_ms, digests)  # fmt: skip
        return done or self._router.run_spans(
            Op.WRITE,
            remote,
            remote_region,
            local_addrs,
            remote_offsets,
            lengths,
            self._timeout(timeout_ms),
            digests,
            fenced,
        )

    def read_spans(
        self,
        remote: SegmentDescriptor,
        remote_region: int,
        local_addrs,
        remote_offsets,
        lengths,
        timeout_ms: float | None = None,
        digests=None,
    ) -> list[TransferError | None]:
        """Array form of batch_read: span j copies remote bytes into local address ``local_addrs[j]``
        (writable registered memory). As write_spans otherwise (``digests`` hash the bytes read)."""
        fast = self._fast
        done = fast and self._fast_spans(fast, True, remote, remote_region, local_addrs, remote_offsets, lengths,
                                         timeout_ms, digests)  # fmt: skip
        return done or self._router.run_spans(
            Op.READ, remote, remote_region, local_addrs, remote_offsets, lengths, self._timeout(timeout_ms), digests
        )

    def spans_registered(self, local_addrs, lengths) -> np.ndarray:
        """Per span (1-D integer arrays of addresses and byte lengths): whether it lies inside one registered
        region (numpy bool array; empty spans count as registered)."""
        addrs, lens = as_u64(local_addrs, "local_addrs"), as_u64(lengths, "lengths")
        index = self._regions.index
        ok = (index.locate(addrs, lens) >= 0) | (lens == 0)
        for j in np.flatnonzero(~ok).tolist():
            ok[j] = index.find(int(addrs[j]), int(lens[j])) is not None
        return ok

    def shm_maps(self):
        """The shm transport's native table of mapped peer regions (native.shm_maps) when shm is this engine's
        first choice, else None: the store client's one-call reads (native.get_many) go through it."""
        first = self._transports[0] if self._transports else None
        return first.maps if isinstance(first, ShmTransport) else None

    def tcp_peers(self):
        """The TCP transport's native pool of idle connections and read routes (native.tcp_peers) when this
        engine has TCP, else None: the store client's one-call reads (native.get_many) go through it."""
        tcp = next((t for t in self._transports if isinstance(t, TcpTransport)), None)
        return None if tcp is None else tcp.peers

    def serve_control(self, kind: str, handler) -> None:
        """Answer control requests of ``kind`` from peers (``control`` below) with ``handler(body: dict, peer
        address) -> reply dict`` (a flat map of scalars and lists: wire.py), run on a TCP server thread; a
        KVPluginsError or ValueError it raises reaches the peer as its TransferFailed text. Peers are authenticated (the cluster secret) before any request.
        Kinds this process does not serve answer "no <kind> control here". Raises ConfigError without TCP."""
        self._tcp("serve_control").server.set_control(kind, handler)

    def control(self, host: str, port: int, body: dict, timeout_ms: float | None = None) -> dict:
        """Send control request ``body`` (a msgpack-able dict with "kind") to the TCP transport of the engine at
        ``host``:``port`` (its descriptor's "tcp" endpoint) and return its handler's reply. One request on a
        pooled authenticated connection. Raises TransferFailed (unreachable, refused, timeout after ``timeout_ms``
        (default config.timeout_ms), or the handler's error), ConfigError without TCP here."""
        deadline = Deadline(self._timeout(timeout_ms))
        return self._tcp("control").control({"host": host, "port": int(port)}, body, deadline)

    def _tcp(self, what: str) -> TcpTransport:
        tcp = next((t for t in self._transports if isinstance(t, TcpTransport)), None)
        if tcp is None:
            raise ConfigError(f"{what} needs the tcp transport; add tcp to transports (now {self.config.transports!r})")
        return tcp

    def route_natively(self, name: str, remote: SegmentDescriptor) -> bool:
        """Route each region of ``remote`` (the segment the master calls ``name``) whose first transport here is
        TCP to it in tcp_peers(), so native reads and writes of it take that transport's pooled connections. A
        region first reached another way (shm, cma, rdma) is not routed. Returns whether any region was."""
        routed = False
        for info in remote.regions:
            first = self._router.first(remote, info.region_id)
            if isinstance(first, TcpTransport):
                first.route(name, remote, info)
                routed = True
        return routed

    def writable_spans(self, spans_per_key: list) -> tuple | None:
        """``spans_per_key`` (a list: per key a list or tuple of (address, bytes) int pairs) as uint64 arrays
        (addresses, lengths, per-key start offsets: key k's spans are [starts[k], starts[k+1])), bytes per key (an
        int list) and the batch's total bytes, when every span lies inside one registered region a read may land in (not
        read-only); else None. One native pass (native.writable_spans); conservative: a span only inside
        overlapping registrations counts as not writable."""
        index = self._regions.index
        return native.writable_spans(spans_per_key, index.np_starts, index.np_ends, index.np_writable, SMALL)

    def registered_spans(self, spans_per_key: list) -> tuple | None:
        """As writable_spans, for spans a write reads from: any registered region (read-only ones too)."""
        index = self._regions.index
        return native.writable_spans(spans_per_key, index.np_starts, index.np_ends, index.np_any, SMALL)

    def submit_write(self, reqs: list[TransferRequest], timeout_ms: float | None = None) -> Future:
        """batch_write on an engine worker thread; a Future of the status list. Raises as batch_write
        for a closed engine or a bad timeout (immediately, not through the Future)."""
        self._timeout(timeout_ms)
        return self._pool.submit(self.batch_write, list(reqs), timeout_ms)

    def submit_read(self, reqs: list[TransferRequest], timeout_ms: float | None = None) -> Future:
        """batch_read on an engine worker thread; a Future of the status list."""
        self._timeout(timeout_ms)
        return self._pool.submit(self.batch_read, list(reqs), timeout_ms)

    def _timeout(self, timeout_ms: float | None) -> float:
        if self._closed:
            raise TransferFailed("this TransferEngine is closed; create a new one")
        t = self.config.timeout_ms if timeout_ms is None else timeout_ms
        if not isinstance(t, (int, float)) or t <= 0:
            raise ValueError(f"timeout_ms={timeout_ms!r}: use a positive number of milliseconds")
        return float(t)

    def stats(self) -> dict[str, Any]:
        """Counters: per transport entries/bytes/failures, fallbacks "from->to", errors by type."""
        return self._router.stats()

    def close(self) -> None:
        """Stop servers and workers, unmap shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fast = self._fast_fenced = ()
        _OPEN.discard(self)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for t in self._transports:
            t.close()
        for owner in self._regions.pop_all():
            if isinstance(owner, shmem.Mapping):
                owner.close()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_OPEN: weakref.WeakSet[TransferEngine] = weakref.WeakSet()  # engines not closed yet


@atexit.register
def _close_open_engines() -> None:
    """At interpreter exit, close the engines their owners left open (a script that never closed its store
    client): their native server threads are joined and their native objects freed before the interpreter
    finalizes, so the process exits 0 and silently (nanobind reported them as leaked instances)."""
    for eng in list(_OPEN):
        with contextlib.suppress(Exception):  # exiting: a failed close must not turn the exit into a traceback
            eng.close()
