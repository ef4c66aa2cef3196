"""One client process of the soak test: ``OPS`` random operations (put / get / exists / remove in byte and
zero-copy forms) on its own keys, plus reads of the other workers' keys. Every payload is a pure function of its
key, so any bytes a read returns must equal it (a reallocated or stale range would differ). The worker keeps
the set of its keys whose put was acknowledged and not removed since: such a key must read back (nothing is
evicted in this test), a removed one must miss. At the end every acknowledged key is read back and compared.
Prints one JSON line of counts; ``wrong``, ``lost`` and ``ghost`` must stay 0.

    python soak_worker.py MASTER WORKER_ID WORKERS KEYS OPS SEED
"""

import json
import sys
import time

import numpy as np
import xxhash

from kvplugins.errors import KeyNotFound, TransferFailed
from kvplugins.store import ClientConfig, StoreClient

OPS = ("put", "put_from", "get", "get_into", "exists", "remove")
WEIGHTS = (0.2, 0.15, 0.2, 0.15, 0.15, 0.15)
MAX_SIZE = 16 << 10


def payload(key: str) -> bytes:
    seed = xxhash.xxh64_intdigest(key.encode())
    return np.random.default_rng(seed).bytes(512 + seed % (MAX_SIZE - 512))


class Worker:
    def __init__(self, master: str, me: int, workers: int, keys: int, seed: int):
        self.c = StoreClient(ClientConfig(master=master))
        self.rng = np.random.default_rng(seed)
        self.mine = [f"w{me}/k{i}" for i in range(keys)]
        self.others = [f"w{w}/k{i}" for w in range(workers) if w != me for i in range(keys)]
        self.present: set[str] = set()
        self.n = dict.fromkeys(OPS + ("hits", "misses", "lease_refused", "wrong", "lost", "ghost"), 0)
        self.errors: list[str] = []
        self.buf = np.zeros(2 * MAX_SIZE, dtype=np.uint8)
        self.base = self.c.register_buffer(self.buf).addr
        self._cache: dict[str, bytes] = {}

    def value(self, key: str) -> bytes:
        v = self._cache.get(key)
        if v is None:
            v = self._cache[key] = payload(key)
        return v

    def step(self) -> None:
        op = OPS[self.rng.choice(len(OPS), p=WEIGHTS)]
        own = op in ("put", "put_from", "remove") or self.rng.random() < 0.7
        key = (self.mine if own else self.others)[self.rng.integers(len(self.mine if own else self.others))]
        self.n[op] += 1
        getattr(self, "op_" + op)(key)

    def op_put(self, key):
        self.c.put(key, self.value(key))
        self.present.add(key)

    def op_put_from(self, key):
        v = self.value(key)
        self.buf[: len(v)] = np.frombuffer(v, dtype=np.uint8)
        self.c.put_from(key, [(self.base, len(v))])
        self.present.add(key)

    def op_get(self, key):
        self.read(key, lambda: self.c.get(key))

    def op_get_into(self, key):
        v = self.value(key)
        off = MAX_SIZE  # the second half: never the put_from source
        self.buf[off : off + len(v)] = 0

        def read():
            self.c.get_into(key, [(self.base + off, len(v))])
            return self.buf[off : off + len(v)].tobytes()

        self.read(key, read)

    def op_exists(self, key):
        found = self.c.exists(key)
        self.check_presence(key, found)

    def op_remove(self, key):
        try:
            self.c.remove(key)
            self.check_presence(key, True)
        except KeyNotFound:
            self.check_presence(key, False)
        self.present.discard(key)

    def read(self, key, fn) -> None:
        try:
            got = fn()
        except KeyNotFound:
            self.n["misses"] += 1
            return self.check_presence(key, False)
        except TransferFailed as e:  # a read that outlived its lease: refused, not wrong bytes
            self.n["lease_refused"] += 1
            self.errors.append(f"{key}: {e}"[:200])
            return
        self.n["hits"] += 1
        self.check_presence(key, True)
        if got != self.value(key):
            self.n["wrong"] += 1
            self.errors.append(f"{key}: wrong bytes ({len(got)} vs {len(self.value(key))})")

    def check_presence(self, key, found: bool) -> None:
        if key not in self.mine:
            return
        if key in self.present and not found:
            self.n["lost"] += 1
            self.errors.append(f"{key}: acknowledged put lost")
        elif key not in self.present and found:
            self.n["ghost"] += 1
            self.errors.append(f"{key}: removed key still found")

    def final_check(self) -> None:
        keys = sorted(self.present)
        for key, got in zip(keys, self.c.batch_get(keys)):
            if isinstance(got, Exception):
                self.n["lost"] += 1
                self.errors.append(f"{key}: final read failed: {got!r}"[:200])
            elif got != self.value(key):
                self.n["wrong"] += 1
                self.errors.append(f"{key}: final read wrong bytes")
        self.n["final_keys"] = len(keys)


def main(master: str, me: int, workers: int, keys: int, ops: int, seed: int) -> None:
    w = Worker(master, me, workers, keys, seed)
    t0 = time.monotonic()
    for _ in range(ops):
        w.step()
    w.final_check()
    w.c.close()
    print(json.dumps({**w.n, "seconds": round(time.monotonic() - t0, 2), "errors": w.errors[:10]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:7]))
