"""The floors the stores are measured against, in the same run and per case: ``memcpy`` (one native memcpy of
the batch's bytes in this process, one thread, between buffers that are not in cache: each round takes the next
slot of a 256 MiB source and a 256 MiB destination, both faulted in, as a store's segment and the workers'
buffers are; a hot-cache memcpy of a 32 MiB batch ran about 1.7x faster on Zen 5) and ``c-tcp-loopback`` (the batch's
bytes over one plain loopback TCP connection between two native threads: kvplugins.transfer.native_tcp).
Their rows have the stores' row shape (put and get carry the same samples) so report.py tables them beside us.
"""

from __future__ import annotations

import time

import numpy as np

from kvplugins import native
from kvplugins.transfer import native_tcp
from storebench.report import summarize
from storebench.workload import Case

MEMCPY, LOOPBACK = "memcpy", "c-tcp-loopback"
ROTATE = 256 << 20  # bytes each memcpy buffer cycles over: well above a last-level cache


def rows(case: Case) -> list[dict]:
    """memcpy and loopback rows for ``case`` (none for a skipped case); rounds = the case's timed rounds."""
    if case.skipped:
        return []
    n, rounds = case.batch_bytes, max(case.iters, 5)
    out = []
    for label, seconds in ((MEMCPY, _memcpy(n, rounds)), (LOOPBACK, native_tcp.loopback_baseline(n, rounds))):
        for op in ("put", "get"):
            out.append(
                {
                    "target": label,
                    "store": "baseline",
                    "mode": label,
                    "op": op,
                    "size": case.size,
                    "batch": case.batch,
                    "case": case.name,
                    "batch_bytes": n,
                    "iters": len(seconds),
                    "warmup": 1,
                    **summarize(seconds, case.batch, n),
                    "verified_objects": 0,
                    "verified_bytes": 0,
                    "skipped": "",
                }
            )
    return out


def _memcpy(n: int, rounds: int) -> list[float]:
    slots = max(2, ROTATE // n)
    src = np.ones(slots * n, dtype=np.uint8)  # faulted in: written once
    dst = np.ones(slots * n, dtype=np.uint8)
    out = []
    for r in range(rounds):
        off = (r % slots) * n
        t = time.perf_counter()
        native.copy(dst.ctypes.data + off, src.ctypes.data + off, n)
        out.append(time.perf_counter() - t)
    return out
