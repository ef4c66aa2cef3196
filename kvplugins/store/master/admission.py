"""Admission (issue #30): a registered segment gets placement only once the master has written to it and read the
bytes back through the transfer core, so a segment nobody can reach (a wrong advertised host, a firewall, a
peer that names memory it does not serve) never attracts a put.

Lifecycle, in call order, all but the probe itself on the master's thread:
  1. register_segment adds the segment as *unadmitted* (SegmentRegistry.unadmitted: no placement, no manifest
     restored yet) and allocates a PROBE_BYTES block in it;
  2. ``Prober.submit`` writes random bytes there and reads them back on the ``kvp-probe`` thread (its own
     TransferEngine: shared memory by fd on this host, else TCP, each authenticated as any peer's), within
     ``admission_probe_ms``;
  3. the op's ``Admission`` (a batches.Deferred: other clients are served meanwhile) answers once every probe
     ended: admitted segments get their manifest back and answer [OK, name]; a failed probe removes the
     segment and answers [UNREACHABLE, why]; the probe block is freed either way.
In-process services (tests, tools) run without a Prober: their segments are admitted at once.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from kvplugins.store.master.batches import Deferred
from kvplugins.transfer import TransferConfig, TransferEngine
from kvplugins.transfer.api import SegmentDescriptor, TransferRequest

log = logging.getLogger(__name__)
PROBE_BYTES = 4096


class Prober:
    """Write-then-read probes of new segments on one background thread. ``timeout_ms``: one probe's deadline."""

    def __init__(self, timeout_ms: float, host: str = "127.0.0.1"):
        self.timeout_ms, self._host = float(timeout_ms), host
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvp-probe")
        self._engine = self._buf = self._region = None
        self._lock = threading.Lock()

    def submit(self, wire: dict, region_id: int, offset: int, nbytes: int) -> Future:
        """A Future of None (the bytes written to ``wire``'s region ``region_id`` at ``offset`` read back equal)
        or the reason (str) they did not."""
        return self._pool.submit(self._probe, wire, region_id, offset, nbytes)

    def _probe(self, wire: dict, region_id: int, offset: int, nbytes: int) -> str | None:
        try:
            engine, region, buf = self._started()
            remote = SegmentDescriptor.from_wire(wire)
            pattern = os.urandom(nbytes)
            buf[:nbytes] = pattern
            buf[nbytes : 2 * nbytes] = bytes(nbytes)
            put = TransferRequest(region, 0, remote, region_id, offset, nbytes)
            get = TransferRequest(region, nbytes, remote, region_id, offset, nbytes)
            [err] = engine.batch_write([put], timeout_ms=self.timeout_ms)
            if err is None:
                [err] = engine.batch_read([get], timeout_ms=self.timeout_ms)
            if err is not None:
                return f"{err}"
            if bytes(buf[nbytes : 2 * nbytes]) != pattern:
                return "the bytes read back differ from the bytes written"
            return None
        except Exception as e:  # noqa: BLE001 - any failure is the probe's answer, never the master's crash
            return f"{type(e).__name__}: {e}"

    def _started(self):
        with self._lock:
            if self._engine is None:
                self._engine = TransferEngine(
                    TransferConfig(host=self._host, transports="shm,tcp", timeout_ms=self.timeout_ms, workers=1)
                )
                self._buf = bytearray(2 * PROBE_BYTES)
                self._region = self._engine.register(self._buf)
            return self._engine, self._region, memoryview(self._buf)

    def close(self) -> None:
        """Join the probe thread and close its engine (every thread joined: the master exits silently)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._engine is not None:
            self._engine.close()
            self._engine = self._region = None


class Admission(Deferred):
    """register_segment's answer while probes run. ``out``: the per-entry answers, with None where
    ``probes[i]`` = (segment, offset of its probe block, Future) decides; ``finish(seg, offset, why)``
    (the service's) frees the block and admits or removes the segment, returning the entry's answer."""

    def __init__(self, out: list, probes: dict, finish):
        self._out, self._probes, self._finish = out, probes, finish

    @property
    def waiting(self) -> bool:
        return not all(fut.done() for _, _, fut in self._probes.values())

    def step(self, now: float) -> bool:
        if self.waiting:
            return False
        for i, (seg, offset, fut) in self._probes.items():
            self._out[i] = self._finish(seg, offset, fut.result())
        self.result = self._out
        return True

    def run(self, now: float):
        for _, _, fut in self._probes.values():
            fut.result()
        return super().run(now)
