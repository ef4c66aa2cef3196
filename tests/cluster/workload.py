"""One workload client of a cluster run, shaped like the connectors: prefix chains of pages, each step asks how
long a prefix is stored (``exists_prefix``), reads that prefix (``batch_get``) and writes the rest (``batch_put``),
recording every operation per key (history.py). Chains are drawn from a pool shared by all clients (prefix reuse
across hosts: the same keys, and since a value is a function of its key, the same bytes).

    python -m tests.cluster.workload --system kvplugins --master ADDR --host-ip 10.99.0.3 --client c3 --host h3 \
        --history DIR/c3.jsonl --run RUN --seed 7 --stop-file DIR/stop [--final KEYS.json]

Runs until ``--stop-file`` exists, then writes its transfer counters beside its history (``<history>.stats.json``)
and exits 0. With ``--final KEYS.json`` it instead reads each listed key once (op ``final_get``) and exits: the
checker's after-the-heal read of every acknowledged object. Each system is a ``Store`` (below); kvplugins' is
``KvpStore``, Mooncake's ``MooncakeStore`` (mooncake_side.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Protocol

from tests.cluster.history import Recorder, digest_of, page_key, value_of

SIZES = (64 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20)  # page sizes of the shared chains
CHAINS = 32  # chains in the shared pool (about 70 MiB in all: stored once, read by every client)
MAX_PAGES = 6
START_WAIT_S = 60.0  # how long a client waits at start for the store to answer (_connect)
FRESH = 0.02  # the share of steps that write a chain of this client's own (2-4 pages of 64-128 KiB)


class Store(Protocol):
    """What a workload needs of a store client (each call may raise; a raise is recorded as "error")."""

    def exists_prefix(self, keys: list[str]) -> int: ...
    def batch_get(self, keys: list[str]) -> list[bytes | None | Exception]:
        """Per key: the bytes, None for a miss, or the exception of that key."""
        ...

    def batch_put(self, keys: list[str], values: list[bytes]) -> list[Exception | None]: ...
    def transfer_stats(self) -> dict: ...
    def close(self) -> None: ...


class KvpStore:
    """kvplugins' StoreClient as a workload Store: puts with 2 replicas, no own segment (an engine host's client)."""

    def __init__(self, master: str, host_ip: str, replicas: int):
        from kvplugins.store.client import StoreClient
        from kvplugins.store.config import ClientConfig
        from kvplugins.store.placement import PutConfig

        cfg = ClientConfig(master=master, host=host_ip, rpc_timeout_ms=1000, transfer_timeout_ms=3000)
        self._c, self._put = _connect(StoreClient, cfg), PutConfig(replicas=replicas)

    def exists_prefix(self, keys: list[str]) -> int:
        return self._c.batch_exists_prefix(keys)

    def batch_get(self, keys: list[str]) -> list[bytes | None | Exception]:
        from kvplugins.errors import KeyNotFound

        return [None if isinstance(v, KeyNotFound) else v for v in self._c.batch_get(keys)]

    def batch_put(self, keys: list[str], values: list[bytes]) -> list[Exception | None]:
        return list(self._c.batch_put(keys, values, self._put))

    def transfer_stats(self) -> dict:
        return self._c.transfer_stats()

    def close(self) -> None:
        self._c.close()


def _connect(client_cls, cfg, wait_s: float = START_WAIT_S):
    """A StoreClient once the store answers, as an engine host waits for its store at start (the first ``info``
    within rpc_timeout_ms can miss a leader that is still recovering, or one under a fault, on a loaded host:
    a workload client that exited then counted as a crash). Raises the last MasterUnreachable after ``wait_s``."""
    from kvplugins.errors import MasterUnreachable

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client_cls(cfg)
        except MasterUnreachable as e:
            if time.monotonic() > deadline:
                raise
            print(f"store not answering yet, retrying: {e}", file=sys.stderr, flush=True)
            time.sleep(0.5)


def open_store(args: argparse.Namespace) -> Store:
    if args.system == "mooncake":
        from tests.cluster.mooncake_side import MooncakeStore

        return MooncakeStore(args.master, args.host_ip, args.replicas)
    return KvpStore(args.master, args.host_ip, args.replicas)


def _chain(rng: random.Random, run: str, client: str, step: int) -> list[str]:
    """The keys of one chain: mostly of the shared pool (its page size and length are functions of its id), now
    and then a fresh one of this client's. Runs stay far below the store's capacity: nothing is evicted, so every
    acknowledged object must be readable at the end (checker.py)."""
    if rng.random() < FRESH:
        size, pages = rng.choice(SIZES[:3]), rng.randint(2, 4)
        return [page_key(run, f"{client}-{step}", i, size) for i in range(pages)]
    cid = rng.randrange(CHAINS)
    shape = random.Random(cid)
    size, pages = shape.choice(SIZES), shape.randint(2, MAX_PAGES)
    return [page_key(run, f"chain{cid}", i, size) for i in range(pages)]


def _get(store: Store, rec: Recorder, keys: list[str], op: str = "get") -> None:
    t0 = time.time()
    try:
        got = store.batch_get(keys)
    except Exception as e:  # noqa: BLE001 - recorded, the history is the verdict
        rec.record(op, keys, t0, ["error"] * len(keys), errors=[repr(e)] * len(keys))
        return
    results = ["miss" if v is None else "error" if isinstance(v, Exception) else "ok" for v in got]
    digests = [digest_of(v) if isinstance(v, bytes) else None for v in got]
    errors = [repr(v) if isinstance(v, Exception) else None for v in got]
    rec.record(op, keys, t0, results, digests, errors)


def _put(store: Store, rec: Recorder, keys: list[str]) -> None:
    t0 = time.time()
    try:
        errs = store.batch_put(keys, [value_of(k) for k in keys])
    except Exception as e:  # noqa: BLE001
        rec.record("put", keys, t0, ["error"] * len(keys), errors=[repr(e)] * len(keys))
        return
    rec.record("put", keys, t0, ["ok" if e is None else "error" for e in errs], errors=[repr(e) for e in errs])


def step(store: Store, rec: Recorder, rng: random.Random, run: str, client: str, n: int) -> None:
    """Step ``n``, connector-shaped, on one chain: exists_prefix, get the stored prefix, put the rest."""
    keys = _chain(rng, run, client, n)
    t0 = time.time()
    try:
        n = store.exists_prefix(keys)
    except Exception as e:  # noqa: BLE001
        rec.record("exists_prefix", keys[:1], t0, ["error"], errors=[repr(e)])
        n = 0
    else:
        rec.record("exists_prefix", keys[:1], t0, ["ok"], digests=[str(n)])
    if n:
        _get(store, rec, keys[:n])
    if n < len(keys):
        _put(store, rec, keys[n:])


def final(store: Store, rec: Recorder, keys: list[str], batch: int = 16) -> None:
    """Read every key once (op final_get), in batches."""
    for i in range(0, len(keys), batch):
        _get(store, rec, keys[i : i + batch], op="final_get")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=("kvplugins", "mooncake"), default="kvplugins")
    p.add_argument("--master", required=True)
    p.add_argument("--host-ip", required=True, help="this host's address (the transfer engine binds it)")
    p.add_argument("--client", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--history", type=Path, required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--stop-file", type=Path)
    p.add_argument("--final", type=Path, help="JSON list of keys to read once, then exit")
    p.add_argument("--pause-ms", type=float, default=50.0, help="think time between steps")
    args = p.parse_args(argv)
    rec = Recorder(args.history, args.client, args.host, args.system)
    store = open_store(args)
    try:
        if args.final is not None:
            final(store, rec, json.loads(args.final.read_text()))
            return
        rng = random.Random(f"{args.seed}/{args.client}")
        for n in itertools.count():
            if args.stop_file is not None and args.stop_file.exists():
                break
            step(store, rec, rng, args.run, args.client, n)
            time.sleep(args.pause_ms / 1000)
        stats = args.history.with_suffix(".stats.json")
        stats.write_text(json.dumps(store.transfer_stats()))
    finally:
        store.close()
        rec.close()


if __name__ == "__main__":
    main()
