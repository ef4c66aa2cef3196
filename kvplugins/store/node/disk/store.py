"""DiskStore: a node's disk tier — the index of its object files, capacity accounting and LRU eviction.

The directory holds an ``ID`` file (its identity for the master), ``objects/`` and ``tmp/``. At start it is
scanned: temp files of interrupted writes are removed, every object file's header is checked (a torn or garbled
one is deleted and counted in ``corrupt``) and indexed. Object bytes are verified
against their checksum on every read (``read_into``); a corrupt file is deleted, counted, and never served.
Capacity: a write that does not fit evicts least recently used files first (their keys are returned so the
master forgets them). Thread-safe (the node's poll worker writes; promote requests read).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvplugins.errors import KeyNotFound, StoreError
from kvplugins.store.node.disk import files
from kvplugins.store.node.disk.files import CorruptFile
from kvplugins.store.process import write_atomic

log = logging.getLogger(__name__)
COUNTERS = ("writes", "reads", "deletes", "evicted", "corrupt", "write_errors")


@dataclass
class Entry:
    size: int  # object bytes
    checksum: int  # xxh3_64 of the object bytes
    path: Path


class DiskStore:
    """Files under ``directory`` holding at most ``capacity`` object bytes (headers not counted)."""

    def __init__(self, directory: str | Path, capacity: int):
        if capacity <= 0:
            raise StoreError(f"disk capacity {capacity} must be > 0 bytes, e.g. --disk-capacity 64GiB")
        self.root, self.capacity = Path(directory), int(capacity)
        self._writer = files.Writer(self.root)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, Entry] = OrderedDict()  # LRU first
        self.used = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.disk_id = _disk_id(self.root)
        self._scan()

    def _scan(self) -> None:
        for tmp in self._writer.tmp.iterdir():
            tmp.unlink(missing_ok=True)  # a write interrupted before its rename
        paths = sorted(self._writer.objects.glob("*/*" + files.SUFFIX), key=lambda p: p.stat().st_mtime)
        for path in paths:
            try:
                key, size, digest = files.read_header(path)
            except (CorruptFile, OSError, UnicodeDecodeError) as e:
                self._discard(path, f"at start: {e}")
                continue
            self._index[key] = Entry(size, digest, path)
            self.used += size
        log.info("disk tier %s: %d objects, %d of %d bytes", self.root, len(self._index), self.used, self.capacity)

    def entries(self) -> list[list]:
        """[[key, size, checksum], ...] of every stored object, least recently used first."""
        with self._lock:
            return [[k, e.size, e.checksum] for k, e in self._index.items()]

    def put(self, key: str, data, digest: int) -> list[str]:
        """Durably store ``data`` (bytes-like; ``digest`` = files.checksum(data)) as ``key``, replacing an older
        copy. Returns the keys evicted (LRU) to make room. Raises StoreError if it exceeds the capacity, OSError."""
        size = memoryview(data).nbytes
        if size > self.capacity:
            raise StoreError(f"{key}: {size} bytes exceed the disk capacity {self.capacity}")
        evicted = self._make_room(key, size)
        try:
            path = self._writer.write(key, data, digest)
        except OSError:
            self.counters["write_errors"] += 1
            raise
        with self._lock:
            old = self._index.pop(key, None)
            self.used += size - (old.size if old else 0)
            self._index[key] = Entry(size, digest, path)
            self.counters["writes"] += 1
        return evicted

    def _make_room(self, key: str, size: int) -> list[str]:
        evicted = []
        with self._lock:
            while self._index and self.used + size > self.capacity:
                victim = next(iter(self._index))
                if victim == key:  # its own older copy is replaced by the write
                    self._index.move_to_end(key)
                    if len(self._index) == 1:
                        break
                    continue
                entry = self._index.pop(victim)
                self.used -= entry.size
                entry.path.unlink(missing_ok=True)
                self.counters["evicted"] += 1
                evicted.append(victim)
        return evicted

    def read_into(self, key: str, dest: memoryview) -> int:
        """Copy ``key``'s verified bytes into ``dest`` (its exact size); returns the checksum. Raises KeyNotFound
        (no such file), CorruptFile (the file failed verification; it is deleted and counted), OSError."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                raise KeyNotFound(key)
            self._index.move_to_end(key)
        try:
            digest = files.read_into(entry.path, key, dest)
        except FileNotFoundError as e:
            self.delete(key)
            raise KeyNotFound(key) from e
        except CorruptFile as e:
            self.delete(key)
            self._discard(entry.path, str(e))
            raise
        self.counters["reads"] += 1
        return digest

    def size_of(self, key: str) -> int | None:
        with self._lock:
            entry = self._index.get(key)
            return entry.size if entry else None

    def delete(self, key: str) -> bool:
        """Remove ``key``'s file; False if it was not stored."""
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return False
            self.used -= entry.size
            self.counters["deletes"] += 1
        entry.path.unlink(missing_ok=True)
        return True

    def _discard(self, path: Path, why: str) -> None:
        self.counters["corrupt"] += 1
        log.warning("disk tier: deleted corrupt file %s", why)
        path.unlink(missing_ok=True)

    def stats(self) -> dict:
        with self._lock:
            return {
                "disk_objects": len(self._index),
                "disk_bytes": self.used,
                "disk_capacity": self.capacity,
                **{f"disk_{k}": v for k, v in self.counters.items()},
            }


def _disk_id(root: Path) -> str:
    """The directory's identity (``ID`` file, made once): how the master recognises this disk after a restart."""
    path = root / "ID"
    if not path.exists():
        write_atomic(path, uuid.uuid4().hex + "\n")
    return path.read_text().strip()
