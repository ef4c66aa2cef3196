"""The recorded history of a cluster run (Jepsen's history): one JSON line per operation per key, written by every
workload process to its own file and read back by the offline checker (checker.py).

A record: ``{"t0": start, "t1": end (time.time(), s), "client": "c3", "host": "h3", "system": "kvplugins" |
"mooncake", "op": "put" | "get" | "exists_prefix" | "final_get", "key": str, "result": "ok" | "miss" | "error",
"digest": blake2b-128 hex of the bytes a get returned (None otherwise), "error": the exception's text or None}``.
A put's "ok" is an acknowledgement; its "error" is indeterminate (it may or may not have stored the object).

Every value is a pure function of its key (``value_of``): the key names its size, the bytes come from a generator
seeded by the key. So "wrong bytes" needs no bookkeeping of writers: a get returned wrong bytes exactly when the
digest it recorded differs from ``digest_of(value_of(key))``. Keys: ``<run>/<chain>/<page index>/<size>``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

RESULTS = ("ok", "miss", "error")
OPS = ("put", "get", "exists_prefix", "final_get")


def page_key(run: str, chain: str, index: int, size: int) -> str:
    """The key of page ``index`` of prefix chain ``chain`` (``size`` bytes)."""
    return f"{run}/{chain}/{index}/{size}"


def size_of(key: str) -> int:
    """The size in bytes a key names (its last path item)."""
    return int(key.rsplit("/", 1)[1])


def value_of(key: str) -> bytes:
    """The one value ever stored under ``key``: ``size_of(key)`` bytes from a generator seeded by the key."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.Generator(np.random.PCG64(seed)).bytes(size_of(key))


def digest_of(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass
class Record:
    t0: float
    t1: float
    client: str
    host: str
    system: str
    op: str
    key: str
    result: str
    digest: str | None = None
    error: str | None = None


class Recorder:
    """Appends Records to one client's history file, one flushed line each (a killed client loses nothing it
    recorded)."""

    def __init__(self, path: Path, client: str, host: str, system: str):
        self._f = open(path, "a", buffering=1)
        self.client, self.host, self.system = client, host, system

    def record(self, op: str, keys: list[str], t0: float, results: list[str], digests=None, errors=None) -> None:
        t1 = time.time()
        for i, key in enumerate(keys):
            rec = Record(
                t0,
                t1,
                self.client,
                self.host,
                self.system,
                op,
                key,
                results[i],
                digests[i] if digests else None,
                errors[i] if errors else None,
            )
            self._f.write(json.dumps(asdict(rec)) + "\n")

    def close(self) -> None:
        self._f.close()


def read(paths: list[Path]) -> Iterator[Record]:
    """Every record of the given history files (a torn last line of a killed writer is skipped)."""
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                yield Record(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue
