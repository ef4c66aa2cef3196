"""Per-entry transport choice, fallback and statistics of a TransferEngine.

Each entry goes to the first transport (in config order, fastest first) that both ends offer and that
reaches the remote region. Entries failing with TransferFailed are retried on their next candidate;
each fallback is counted and logged once per (transport, reason). OutOfRange is final. A small batch that ran
whole on a region's first candidate tells that transport (Transport.first_choice): TCP and cma then take the next
small batches there natively from the engine's entry (tcp_fast.py, cma_fast.py).
"""

from __future__ import annotations

import logging
import operator
import re
import threading
from collections import Counter
from typing import Any

import numpy as np

from kvplugins import native
from kvplugins.errors import OutOfRange, TransferError, TransferFailed
from kvplugins.transfer.api import RegionInfo, SegmentDescriptor, TransferRequest
from kvplugins.transfer.memory import RegionTable, span_addr
from kvplugins.transfer.spans import SMALL, SpanBatch, as_u64, prepare, prepare_small, small_lists
from kvplugins.transfer.transport import Deadline, Entry, Op, Transport

log = logging.getLogger("kvplugins.transfer")
_MAX_LOGGED = 1024


class Router:
    """Runs batches over an ordered list of transports and keeps the counters for stats()."""

    def __init__(self, transports: list[Transport], regions: RegionTable):
        self._transports, self._regions = transports, regions
        first = transports[0] if transports else None
        self._fast = first if first is not None and first.name == "rdma" else None  # RdmaTransport.fast_spans
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._logged: set[tuple[str, str]] = set()

    def run(self, op: Op, reqs: list[TransferRequest], timeout_ms: float) -> list[TransferError | None]:
        deadline = Deadline(timeout_ms)
        if self._fast is not None and 0 < len(reqs) <= SMALL:
            one = one_region(reqs)  # a write into a region read-only to peers: refused below, never posted
            if (
                one is not None
                and not (op is Op.WRITE and refused_write(one[0], one[1]))
                and self._fast_spans(op, one[0], one[1], one[2], deadline)
            ):
                return [None] * len(reqs)
        status: list[TransferError | None] = [None] * len(reqs)
        pending: dict[int, tuple[Entry, list[Transport]]] = {}
        pins: dict[int, Any] = {}  # per batch: local region id -> pin
        remotes: dict[tuple, tuple] = {}  # per batch: (descriptor, region id) -> (RegionInfo, candidates)
        for i, req in enumerate(reqs):
            try:
                entry, cands = self._entry(req, pins, remotes)
                if op is Op.READ and entry.local.readonly:
                    raise OutOfRange(f"local region {entry.local.region_id} is read-only; read into writable memory")
                if op is Op.WRITE and entry.remote_region.readonly:
                    raise refused_write(entry.remote, entry.remote_region.region_id) or OutOfRange("read-only")
                if entry.length:
                    pending[i] = (entry, cands)
            except TransferError as e:
                status[i] = e
        first = len(pending) <= SMALL  # a small batch's first round: transports learn their first choices
        while pending:
            pending = self._round(op, pending, status, deadline, first)
            first = False
        self._count(op, status)
        return status

    def run_spans(
        self,
        op: Op,
        remote: SegmentDescriptor,
        region_id: int,
        addrs,
        roffs,
        lens,
        timeout_ms: float,
        digests: np.ndarray | None = None,
        fenced: bool = False,
    ) -> list[TransferError | None]:
        """The array form (spans.py): every span between local memory and region ``region_id`` of ``remote``.
        ``digests``: filled with each moved span's xxh3_64 (TransferEngine.write_spans): by the transport in its
        copy pass where the first candidate can (``hashes_in_copy``; spans then stay uncoalesced), else natively
        here over the caller's spans in local memory after the move (the source of a write, the destination of
        a read). ``fenced``: see Deadline."""
        refused = refused_write(remote, region_id) if op is Op.WRITE else None
        if refused is not None:
            return [refused] * len(lens)
        deadline = Deadline(timeout_ms, fenced)
        lists = small_lists(addrs, roffs, lens)
        small = lists is not None
        if small and self._fast is not None and self._fast_spans(op, remote, region_id, lists, deadline):
            if digests is not None:  # hashed here after the move, as below for a transport that cannot hash
                n = len(lists[2])
                a, ln = np.asarray(lists[0], dtype=np.uint64), np.asarray(lists[2], dtype=np.uint64)
                digests[:] = native.hash_keys(a, ln, np.arange(n), n)
            return [None] * len(lists[2])
        if lists is not None:
            addrs, roffs, lens = lists
        else:
            addrs, roffs, lens = as_u64(addrs, "local_addrs"), as_u64(roffs, "remote_offsets"), as_u64(lens, "lengths")
        if not len(addrs) == len(roffs) == len(lens):
            raise ValueError(
                f"local_addrs, remote_offsets and lengths differ in length "
                f"({len(addrs)}, {len(roffs)}, {len(lens)}); pass one value per span"
            )
        status: list[TransferError | None] = [None] * len(lens)
        try:
            info, cands = self._remote(remote, int(region_id))
        except TransferError as e:
            status = [e] * len(lens)
            cands = []
        if digests is not None and (
            not isinstance(digests, np.ndarray)
            or digests.dtype != np.uint64
            or digests.shape != (len(lens),)
            or not digests.flags.writeable
        ):
            raise ValueError(
                f"digests must be a writable uint64 array of {len(lens)} (one per span), got "
                f"{type(digests).__name__} {getattr(digests, 'dtype', '')} {getattr(digests, 'shape', '')}"
            )
        if cands:
            fused = digests is not None and cands[0].hashes_in_copy  # hash per span: do not coalesce
            batch, valid, group = (prepare_small if small else prepare)(
                self._regions, remote, info, addrs, roffs, lens, op is Op.WRITE, status, not fused
            )
            if batch is not None:
                if fused:  # every span valid: the transport hashes straight into the caller's array
                    batch.digests = digests if len(valid) == len(lens) else np.zeros(len(batch), dtype=np.uint64)
                merged = self._spans_rounds(op, batch, cands, deadline)
                if digests is not None and not (batch.hashed and batch.digests is digests):
                    vi = np.asarray(valid, dtype=np.int64)
                    digests[vi] = (
                        batch.digests
                        if batch.hashed
                        else native.hash_keys(
                            np.asarray(addrs, dtype=np.uint64)[vi],
                            np.asarray(lens, dtype=np.uint64)[vi],
                            np.arange(len(vi)),
                            len(vi),
                        )
                    )
                if merged.count(None) != len(merged):
                    for j, g in zip(valid, group):
                        status[j] = merged[g]
        self._count(op, status)
        return status

    def _fast_spans(self, op: Op, remote: SegmentDescriptor, region_id: int, lists: list, deadline: Deadline) -> bool:
        """A small batch through the first transport's fast path (RdmaTransport.fast_spans; TransferEngine tried
        its native route table before), counted as run_spans counts it; False where it does not apply or failed
        (run_spans then runs it its general way)."""
        try:
            done = self._fast.fast_spans(op, remote, region_id, tuple(lists), deadline, self._regions)
        except Exception:  # noqa: BLE001 - as _transfer: the general path runs the batch and names the error
            log.exception("the %s fast path raised", self._fast.name)
            return False
        if done:
            self._record(self._fast.name, len(lists[2]), sum(lists[2]), 0)
            self._count(op, [])
        return done

    def _spans_rounds(self, op: Op, batch: SpanBatch, cands: list[Transport], deadline: Deadline) -> list:
        """Run ``batch`` on the first candidate; TransferFailed spans retry on the next ones."""
        out: list[TransferError | None] = [None] * len(batch)
        todo, part = list(range(len(batch))), batch
        for k, transport in enumerate(cands):
            res = self._transfer_spans(transport, op, part, deadline)
            failed = [] if res is None else [j for j, e in enumerate(res) if e is not None]
            self._record(
                transport.name,
                len(part) - len(failed),
                part.nbytes() - sum(int(part.lens[j]) for j in failed),
                len(failed),
            )
            retry = []
            for j in failed:
                out[todo[j]] = res[j]
                if isinstance(res[j], TransferFailed) and k + 1 < len(cands):
                    retry.append(j)
            if not failed and k == 0 and len(part) <= SMALL:
                transport.first_choice(batch.remote, batch.info)
            if not retry:
                break
            self._fallback(transport.name, cands[k + 1].name, res[retry[0]])
            todo, part = [todo[j] for j in retry], part.subset(retry)
            batch.hashed = False  # a retried part moved on another transport: hash locally
            for i in todo:
                out[i] = None
        return out

    @staticmethod
    def _transfer_spans(transport: Transport, op: Op, batch: SpanBatch, deadline: Deadline):
        try:
            return transport.transfer_spans(op, batch, deadline)
        except Exception as e:  # noqa: BLE001 - as _transfer
            log.exception("%s transport raised during a span batch", transport.name)
            return [TransferFailed(f"{transport.name} transport error: {type(e).__name__}: {e}")] * len(batch)

    def _entry(self, req: TransferRequest, pins: dict, remotes: dict) -> tuple[Entry, list[Transport]]:
        if not isinstance(req, TransferRequest):
            raise TypeError(f"batch entries must be TransferRequest, got {type(req).__name__}")
        try:
            local_off, remote_off, length = map(operator.index, (req.local_offset, req.remote_offset, req.length))
        except TypeError:
            raise OutOfRange(
                f"offsets and length must be integers, got {req.local_offset!r}, {req.remote_offset!r}, {req.length!r}"
            ) from None
        if req.local.device is not None:
            raise OutOfRange(
                f"local region {req.local.region_id} is {req.local.device.kind} device memory: a batch moves host "
                "memory; copy it through a registered host buffer (kvplugins.mooncake.te stages it)"
            )
        key = req.local.region_id
        pin = pins[key] if key in pins else pins.setdefault(key, self._regions.pin(req.local))
        addr = span_addr(req.local, local_off, length, "local")
        rkey = (id(req.remote), req.remote_region)
        info, cands = remotes.get(rkey) or remotes.setdefault(rkey, self._remote(req.remote, req.remote_region))
        if remote_off < 0 or remote_off + length > info.length:
            raise OutOfRange(
                f"remote region {info.region_id} of {req.remote.segment_id} (length {info.length}): "
                f"offset {remote_off} + length {length} is outside it"
            )
        return Entry(req.local, addr, req.remote, info, remote_off, length, pin), cands

    def first(self, remote: SegmentDescriptor, region_id: int) -> Transport | None:
        """The transport a batch to region ``region_id`` of ``remote`` tries first, or None (no common one)."""
        try:
            return self._remote(remote, region_id)[1][0]
        except TransferError:
            return None

    def _remote(self, remote: SegmentDescriptor, region_id: int) -> tuple[RegionInfo, list[Transport]]:
        info = remote.region(region_id)
        cands = [t for t in self._transports if t.name in remote.transports and t.reaches(remote, info)]
        if not cands:
            raise TransferFailed(
                f"no common transport with {remote.segment_id}: this engine offers "
                f"{[t.name for t in self._transports]}, the peer {list(remote.transports)}"
            )
        return info, cands

    def _round(self, op: Op, pending: dict, status: list, deadline: Deadline, first: bool) -> dict:
        """One try of every pending entry on its next candidate; ``first``: a small batch's first round (each
        region's entries that all went well tell their transport it was the first choice there)."""
        by_transport: dict[int, list[int]] = {}
        for i, (_, cands) in pending.items():
            by_transport.setdefault(id(cands[0]), []).append(i)
        retry: dict[int, tuple[Entry, list[Transport]]] = {}
        for idxs in by_transport.values():
            transport = pending[idxs[0]][1][0]
            results = self._transfer(transport, op, [pending[i][0] for i in idxs], deadline)
            done = [0, 0, 0]  # entries, bytes, failed
            for i, err in zip(idxs, results):
                entry, cands = pending[i]
                done[0 if err is None else 2] += 1
                done[1] += entry.length if err is None else 0
                if isinstance(err, TransferFailed) and len(cands) > 1:
                    self._fallback(transport.name, cands[1].name, err)
                    retry[i] = (entry, cands[1:])
                else:
                    status[i] = err
            self._record(transport.name, *done)
            if first and not done[2]:
                _first_choices(transport, [pending[i][0] for i in idxs])
        return retry

    @staticmethod
    def _transfer(transport: Transport, op: Op, entries: list[Entry], deadline: Deadline) -> list:
        """transport.transfer(), with an unexpected exception turned into TransferFailed for every entry
        (so the next transport gets them) instead of escaping the batch."""
        try:
            return transport.transfer(op, entries, deadline)
        except Exception as e:  # noqa: BLE001 - a transport bug or a closed engine must not lose the batch
            log.exception("%s transport raised during a batch", transport.name)
            return [TransferFailed(f"{transport.name} transport error: {type(e).__name__}: {e}")] * len(entries)

    def _record(self, name: str, entries: int, nbytes: int, failed: int) -> None:
        with self._lock:
            self._counts[(name, "entries")] += entries
            self._counts[(name, "bytes")] += nbytes
            self._counts[(name, "failed")] += failed

    def _fallback(self, src: str, dst: str, err: TransferError) -> None:
        reason = re.sub(r"\d+", "N", str(err))
        with self._lock:
            self._counts[("fallbacks", f"{src}->{dst}")] += 1
            first = (src, reason) not in self._logged and len(self._logged) < _MAX_LOGGED
            self._logged.add((src, reason))
        if first:
            log.warning("transfer fell back from %s to %s: %s", src, dst, err)

    def _count(self, op: Op, status: list) -> None:
        errors = [type(e).__name__ for e in status if e is not None]
        with self._lock:
            self._counts[("batches", op.name.lower())] += 1
            for name in errors:
                self._counts[("errors", name)] += 1

    def stats(self) -> dict[str, Any]:
        """{"batches": {...}, "errors": {...}, "fallbacks": {"shm->tcp": n}, "<transport>": {entries, bytes,
        failed}}; every transport in use appears with zeros before its first entry."""
        out: dict[str, Any] = {"batches": {}, "errors": {}, "fallbacks": {}}
        for t in self._transports:
            own = t.stats()
            native = own.pop("native", None)  # rdma: batches done by its native fast path, not counted here
            out[t.name] = {"entries": 0, "bytes": 0, "failed": 0, **own}  # its own: the native reads
            if native:
                out[t.name]["entries"] += native["entries"]
                out[t.name]["bytes"] += native["bytes"]
                for op in ("read", "write"):
                    if native[op + "s"]:
                        out["batches"][op] = out["batches"].get(op, 0) + native[op + "s"]
        with self._lock:
            for (group, key), n in self._counts.items():
                got = out.setdefault(group, {})
                got[key] = got.get(key, 0) + n
        return out


def _first_choices(transport: Transport, entries: list[Entry]) -> None:
    """Tell ``transport`` it was the first choice for each remote region of ``entries`` (once per region)."""
    regions = {(id(e.remote), e.remote_region.region_id): e for e in entries}
    for e in regions.values():
        transport.first_choice(e.remote, e.remote_region)


def one_region(reqs: list) -> tuple[SegmentDescriptor, int, list] | None:
    """(remote, region id, [local addresses, remote offsets, lengths]) of a batch of TransferRequests that all go to
    one remote region, each a non-empty range of its local region (int fields), for the fast path; else None."""
    first = reqs[0]
    if type(first) is not TransferRequest:
        return None
    remote, region_id = first.remote, first.remote_region
    addrs, roffs, lens = [], [], []
    for req in reqs:
        if type(req) is not TransferRequest or req.remote is not remote or req.remote_region != region_id:
            return None
        off, n = req.local_offset, req.length
        if type(off) is not int or type(n) is not int or off < 0 or n <= 0 or off + n > req.local.length:
            return None
        addrs.append(req.local.addr + off)
        roffs.append(req.remote_offset)
        lens.append(n)
    return remote, region_id, [addrs, roffs, lens]


def refused_write(remote: SegmentDescriptor, region_id: int) -> OutOfRange | None:
    """The error of a write into region ``region_id`` of ``remote`` when its owner made it read-only to peers
    (RegionInfo.readonly), else None (an unknown region is reported where the batch resolves it)."""
    try:
        info = remote.region(region_id)
    except OutOfRange:
        return None
    if not info.readonly:
        return None
    return OutOfRange(f"region {region_id} of {remote.segment_id} is read-only to peers: read it, never write it")
