"""The shared pool side of a replay: the real store, reached through a StoreClient.

``private_store`` runs an embedded store (``kvplugins up``: master + one DRAM segment in one process) sized for
one capacity, in its own process and discovery file, and stops it afterwards. ``PoolOps`` does what an engine's
connector does per request: a ``batch_exists_prefix`` lookup, a ``batch_get`` of the hit prefix (which also
refreshes the objects' recency in the master's LRU), and a ``batch_put`` of the blocks computed by prefill.
Every stored object is the xxh64 of its key repeated, so a get that returns any other byte is counted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

import xxhash

from kvplugins.errors import KVPluginsError, StoreError
from kvplugins.store.embedded import CLI, wait_ready

log = logging.getLogger(__name__)
LEASE_TTL_MS = 100  # a private store's read lease: replayed reads take well under this
# An as-fast-as-possible replay compresses the trace's hours into seconds, so a grace measured in wall time would
# protect thousands of requests' blocks from eviction: it runs with none. Realtime keeps the lease as the grace.
START_TIMEOUT_S = 30.0


@contextlib.contextmanager
def private_store(segment_bytes: int, grace_ms: int, lease_ttl_ms: int = LEASE_TTL_MS):
    """Yield the master address of a fresh embedded store with one ``segment_bytes`` segment (default
    watermarks: eviction from 95% down to 85%, LRU) and an eviction grace of ``grace_ms`` (-1 = the lease).
    Raises StoreError if it does not start in 30 s."""
    with tempfile.TemporaryDirectory(prefix="kvp-replay-") as tmp:
        path = Path(tmp) / "up.json"
        env = {**os.environ, "KVPLUGINS_UP_DISCOVERY_FILE": str(path)}
        args = [
            "up",
            "--port",
            "0",
            "--segment-size",
            str(segment_bytes),
            "--lease-ttl-ms",
            str(lease_ttl_ms),
            "--eviction-grace-ms",
            str(grace_ms),
        ]
        with open(Path(tmp) / "up.log", "wb") as log:
            proc = subprocess.Popen(
                CLI + args,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            try:
                info = wait_ready(path, proc.pid, START_TIMEOUT_S, lambda: proc.poll() is None)
            except StoreError as e:
                raise StoreError(f"{e}: {(Path(tmp) / 'up.log').read_text()[-800:]}") from None
            yield info["master"]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def digest(key: str) -> bytes:
    return xxhash.xxh64_digest(key.encode())


def value_of(key: str, size: int) -> bytes:
    """The ``size`` bytes stored under ``key``: its xxh64 digest repeated, so a get can check every byte."""
    d = digest(key)
    return (d * (size // 8 + 1))[:size]


class PoolOps:
    """One engine's view of the pool: keys ``<namespace>/<block id>``, objects of ``object_bytes`` bytes.
    ``latency``: per op ("exists", "get", "put") the ms of each call, when ``timed``."""

    def __init__(self, client, namespace: str, object_bytes: int, timed: bool = False):
        self.client, self.ns, self.object_bytes, self.timed = client, namespace, object_bytes, timed
        self.latency = {"exists": [], "get": [], "put": []}
        self.wrong_bytes = self.get_misses = self.puts = self.put_failures = self.gets = 0

    def keys(self, blocks) -> list[str]:
        return [f"{self.ns}/{b}" for b in blocks]

    def prefix(self, keys: list[str]) -> int:
        """How many of ``keys`` from the first are stored (one RPC)."""
        return self._timed("exists", self.client.batch_exists_prefix, keys) if keys else 0

    def fetch(self, keys: list[str]) -> None:
        """Read the hit prefix, as a load would; counts misses (evicted in between) and wrong bytes."""
        if not keys:
            return
        values = self._timed("get", self.client.batch_get, keys)
        self.gets += len(keys)
        missed = [(k, v) for k, v in zip(keys, values) if isinstance(v, KVPluginsError)]
        if missed:  # a miss, or the key's read failed (StoreError, TransferFailed): named, so a run can trace it
            self.get_misses += len(missed)
            log.warning("%d of %d hit reads missed (first: %s: %s: %s)", len(missed), len(keys), missed[0][0],
                        type(missed[0][1]).__name__, missed[0][1])  # fmt: skip
        for k, v in zip(keys, values):
            if not isinstance(v, KVPluginsError) and v != value_of(k, self.object_bytes):
                self.wrong_bytes += 1
                log.error("wrong bytes for %s: %d bytes starting %s, want %d starting %s", k, len(v), bytes(v[:8]).hex(),
                          self.object_bytes, digest(k).hex())  # fmt: skip

    def store(self, keys: list[str]) -> None:
        """Put the blocks prefill computed; a failed put (StoreFull under load) is counted, not raised."""
        if not keys:
            return
        n = self.object_bytes
        errs = self._timed("put", self.client.batch_put, keys, [value_of(k, n) for k in keys])
        self.puts += len(keys)
        self.put_failures += sum(e is not None for e in errs)

    def _timed(self, op: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        if self.timed:
            self.latency[op].append((time.perf_counter() - t0) * 1000)
        return out
