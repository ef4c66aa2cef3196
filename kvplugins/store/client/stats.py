"""Counters and latency percentiles of one StoreClient (its ``stats()``)."""

from __future__ import annotations

import threading
import time
from collections import deque

from kvplugins.errors import KeyNotFound

WINDOW = 4096  # latency samples kept per kind


class ClientStats:
    def __init__(self):
        self._lock = threading.Lock()
        self._c = dict.fromkeys(
            (
                "puts",
                "gets",
                "hits",
                "misses",
                "errors",
                "bytes_put",
                "bytes_got",
                "commit_failures",
                "checksum_errors",
                "corrupt_reported",
                "lease_rereads",
            ),
            0,
        )
        self._lat = {"put": deque(maxlen=WINDOW), "get": deque(maxlen=WINDOW)}

    def record(self, kind: str, sizes: list[int], out, t0: float) -> None:
        """Count one batch of ``kind`` ('put'/'get') started at perf_counter ``t0``; ``sizes``: bytes per key."""
        us = (time.perf_counter() - t0) * 1e6
        done = misses = errors = 0
        nbytes = 0
        if out.count(None) == len(out):  # every key done: no loop
            done, nbytes = len(out), int(sum(sizes))
        else:
            for size, err in zip(sizes, out):
                if err is None:
                    done += 1
                    nbytes += size
                elif isinstance(err, KeyNotFound):
                    misses += 1
                else:
                    errors += 1
        with self._lock:
            self._lat[kind].append(us)
            self._c[kind + "s"] += len(out)
            self._c["bytes_" + ("put" if kind == "put" else "got")] += nbytes
            self._c["hits"] += done if kind == "get" else 0
            self._c["misses"] += misses
            self._c["errors"] += errors

    def commit_failed(self, n: int) -> None:
        """``n`` pipelined put_commits were refused or lost (their puts had returned success)."""
        with self._lock:
            self._c["commit_failures"] += n

    def checksum_failed(self, n: int, reported: int) -> None:
        """``n`` replica reads did not match their checksum; ``reported`` of them the master dropped."""
        with self._lock:
            self._c["checksum_errors"] += n
            self._c["corrupt_reported"] += reported

    def lease_reread(self, n: int) -> None:
        """``n`` entries whose read ended after its lease are read again under a new one."""
        with self._lock:
            self._c["lease_rereads"] += n

    def snapshot(self) -> dict:
        with self._lock:
            out = dict(self._c)
            for kind, lat in self._lat.items():
                s = sorted(lat)
                out[f"{kind}_batch_p50_us"] = s[len(s) // 2] if s else 0.0
                out[f"{kind}_batch_p99_us"] = s[min(len(s) - 1, int(len(s) * 0.99))] if s else 0.0
        return out
