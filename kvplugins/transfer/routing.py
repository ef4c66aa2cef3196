"""Per-entry transport choice, fallback and statistics of a TransferEngine.

Each entry goes to the first transport (in config order, fastest first) that both ends offer and that
reaches the remote region. Entries failing with TransferFailed are retried on their next candidate;
each fallback is counted and logged once per (transport, reason). OutOfRange is final.
"""
from __future__ import annotations

import logging
import operator
import re
import threading
from collections import Counter
from typing import Any

from kvplugins.errors import OutOfRange, TransferError, TransferFailed
from kvplugins.transfer.api import TransferRequest
from kvplugins.transfer.memory import RegionTable
from kvplugins.transfer.transport import Deadline, Entry, Op, Transport

log = logging.getLogger("kvplugins.transfer")
_MAX_LOGGED = 1024


class Router:
    """Runs batches over an ordered list of transports and keeps the counters for stats()."""

    def __init__(self, transports: list[Transport], regions: RegionTable):
        self._transports, self._regions = transports, regions
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._logged: set[tuple[str, str]] = set()

    def run(self, op: Op, reqs: list[TransferRequest], timeout_ms: float) -> list[TransferError | None]:
        deadline = Deadline(timeout_ms)
        status: list[TransferError | None] = [None] * len(reqs)
        pending: dict[int, tuple[Entry, list[Transport]]] = {}
        for i, req in enumerate(reqs):
            try:
                entry = self._entry(req)
                if entry.length:
                    pending[i] = (entry, self._candidates(entry))
            except TransferError as e:
                status[i] = e
        while pending:
            pending = self._round(op, pending, status, deadline)
        self._count(op, reqs, status)
        return status

    def _entry(self, req: TransferRequest) -> Entry:
        if not isinstance(req, TransferRequest):
            raise TypeError(f"batch entries must be TransferRequest, got {type(req).__name__}")
        try:
            local_off, remote_off, length = map(operator.index, (req.local_offset, req.remote_offset, req.length))
        except TypeError:
            raise OutOfRange(f"offsets and length must be integers, got {req.local_offset!r}, "
                             f"{req.remote_offset!r}, {req.length!r}") from None
        addr, pin = self._regions.check_local(req.local, local_off, length)
        info = req.remote.region(req.remote_region)
        if remote_off < 0 or remote_off + length > info.length:
            raise OutOfRange(f"remote region {info.region_id} of {req.remote.segment_id} (length {info.length}): "
                             f"offset {remote_off} + length {length} is outside it")
        return Entry(req.local, addr, req.remote, info, remote_off, length, pin)

    def _candidates(self, e: Entry) -> list[Transport]:
        cands = [t for t in self._transports if t.name in e.remote.transports and t.reaches(e.remote, e.remote_region)]
        if not cands:
            raise TransferFailed(f"no common transport with {e.remote.segment_id}: this engine offers "
                                 f"{[t.name for t in self._transports]}, the peer {list(e.remote.transports)}")
        return cands

    def _round(self, op: Op, pending: dict, status: list, deadline: Deadline) -> dict:
        by_transport: dict[int, list[int]] = {}
        for i, (_, cands) in pending.items():
            by_transport.setdefault(id(cands[0]), []).append(i)
        retry: dict[int, tuple[Entry, list[Transport]]] = {}
        for idxs in by_transport.values():
            transport = pending[idxs[0]][1][0]
            results = transport.transfer(op, [pending[i][0] for i in idxs], deadline)
            for i, err in zip(idxs, results):
                entry, cands = pending[i]
                self._record(transport.name, entry.length, err)
                if isinstance(err, TransferFailed) and len(cands) > 1:
                    self._fallback(transport.name, cands[1].name, err)
                    retry[i] = (entry, cands[1:])
                else:
                    status[i] = err
        return retry

    def _record(self, name: str, nbytes: int, err: TransferError | None) -> None:
        with self._lock:
            if err is None:
                self._counts[(name, "entries")] += 1
                self._counts[(name, "bytes")] += nbytes
            else:
                self._counts[(name, "failed")] += 1

    def _fallback(self, src: str, dst: str, err: TransferError) -> None:
        reason = re.sub(r"\d+", "N", str(err))
        with self._lock:
            self._counts[("fallbacks", f"{src}->{dst}")] += 1
            first = (src, reason) not in self._logged and len(self._logged) < _MAX_LOGGED
            self._logged.add((src, reason))
        if first:
            log.warning("transfer fell back from %s to %s: %s", src, dst, err)

    def _count(self, op: Op, reqs: list, status: list) -> None:
        with self._lock:
            self._counts[("batches", op.name.lower())] += 1
            for err in status:
                if err is not None:
                    self._counts[("errors", type(err).__name__)] += 1

    def stats(self) -> dict[str, Any]:
        """{"batches": {...}, "errors": {...}, "fallbacks": {"shm->tcp": n}, "<transport>": {entries, bytes,
        failed}}; every transport in use appears with zeros before its first entry."""
        out: dict[str, Any] = {"batches": {}, "errors": {}, "fallbacks": {}}
        for t in self._transports:
            out[t.name] = {"entries": 0, "bytes": 0, "failed": 0}
        with self._lock:
            for (group, key), n in self._counts.items():
                out.setdefault(group, {})[key] = n
        return out
