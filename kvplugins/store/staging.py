"""The registered staging buffer behind the bytes forms (put/get/batch_put/batch_get): bytes are copied into
(or out of) it and move through the transfer core like any registered buffer. It grows (doubling) on demand;
one bytes call uses it at a time."""
from __future__ import annotations

import contextlib
import threading

import numpy as np


class Staging:
    def __init__(self, engine, initial_bytes: int):
        self._engine = engine
        self._lock = threading.Lock()
        self._arr = None
        self._region = None
        self._size = max(int(initial_bytes), 4096)

    @contextlib.contextmanager
    def use(self, nbytes: int):
        """Yield (base address, writable memoryview) of at least ``nbytes`` registered bytes."""
        with self._lock:
            if self._region is None or nbytes > self._arr.nbytes:
                self._grow(nbytes)
            yield self._region.addr, memoryview(self._arr)

    def _grow(self, nbytes: int) -> None:
        while self._size < nbytes:
            self._size *= 2
        if self._region is not None:
            self._engine.unregister(self._region)
        self._arr = np.empty(self._size, dtype=np.uint8)
        self._region = self._engine.register(self._arr)

    def close(self) -> None:
        with self._lock:
            if self._region is not None:
                self._engine.unregister(self._region)
                self._region = self._arr = None
