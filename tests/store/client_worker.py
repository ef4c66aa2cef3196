"""A client process for the concurrency test: puts its own keys (bytes, batch and zero-copy forms), then reads
every worker's keys and checks each byte against the deterministic payload. Prints one JSON line.

    python client_worker.py MASTER WORKER_ID WORKERS KEYS
"""

import hashlib
import json
import sys
import time

import numpy as np

from kvplugins.errors import KeyNotFound
from kvplugins.store import ClientConfig, StoreClient


def payload(worker: int, i: int) -> bytes:
    n = 1000 + (worker * 7919 + i * 104729) % 60000
    return np.random.default_rng(worker * 100003 + i).bytes(n)


def main(master: str, me: int, workers: int, keys: int) -> None:
    c = StoreClient(ClientConfig(master=master))
    half = keys // 2
    for i in range(half):  # single puts
        c.put(f"w{me}/k{i}", payload(me, i))
    rest = list(range(half, keys))  # one zero-copy batch
    datas = [payload(me, i) for i in rest]
    buf = np.frombuffer(b"".join(datas), dtype=np.uint8).copy()
    region = c.register_buffer(buf)
    spans, off = [], 0
    for d in datas:
        spans.append([(region.addr + off, len(d))])
        off += len(d)
    assert c.batch_put_from([f"w{me}/k{i}" for i in rest], spans) == [None] * len(rest)
    c.put(f"w{me}/done", b"1")
    deadline = time.monotonic() + 20
    while not all(c.batch_exists([f"w{w}/done" for w in range(workers)])):
        if time.monotonic() > deadline:
            raise SystemExit("peers never finished")
        time.sleep(0.02)
    bad = misses = checked = 0
    for w in range(workers):
        got = c.batch_get([f"w{w}/k{i}" for i in range(keys)])
        for i, value in enumerate(got):
            if isinstance(value, KeyNotFound):
                misses += 1
            elif hashlib.sha256(value).digest() != hashlib.sha256(payload(w, i)).digest():
                bad += 1
            else:
                checked += 1
    print(json.dumps({"worker": me, "bad": bad, "misses": misses, "checked": checked}))
    c.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
