#!/usr/bin/env python3
"""The master process's memory per object, ours and Mooncake's (issue #18 part 4), on the same workload.

    .venv/bin/python benchmarks/master_memory.py [--objects 1000000] [--stores kvp,mooncake]

Per store: its master and one segment process on loopback (benchmarks/storebench/clusters.py; with
mooncake among ``--stores`` everything runs in a private network namespace, as store_bench.py does, and needs root),
then one client puts N 64-byte objects with 48-byte keys (as master_scale.py makes them) in batches of 1,000
through the store's own zero-copy batch API (our StoreClient.batch_put_from over TCP; Mooncake's
batch_put_from), checking every key's result. Reports the master process's RSS growth per object (VmRSS from
/proc before and after the puts) and the client's puts/s. Our master is `kvplugins master`; Mooncake's is
`mooncake_master` 0.3.13 (its metadata lives in the master; its HTTP metadata server runs in the same process).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from master_scale import keys as make_keys, rss_bytes as rss  # noqa: E402
from storebench import clusters, netns  # noqa: E402
from storebench.clients import open_client  # noqa: E402

SIZE, BATCH = 64, 1000


def measure(target, n: int, key_bytes: int) -> dict:
    buf = np.arange(SIZE * BATCH, dtype=np.uint64).view(np.uint8)[: SIZE * BATCH].copy()
    client = open_client(target.backend, target.cfg, buf)
    try:
        ks = make_keys(n, key_bytes)
        time.sleep(0.5)
        before = rss(target.master_pid)
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            client.bind("put", ks[i : i + BATCH], SIZE)()
        put_s = time.perf_counter() - t0
        time.sleep(0.5)
        grown = rss(target.master_pid) - before
    finally:
        client.close()
    return {
        "store": target.label,
        "objects": n,
        "bytes_per_object": round(grown / n),
        "master_rss_mib": round(rss(target.master_pid) / 2**20),
        "puts_per_s": round(n / put_s),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--key-bytes", type=int, default=48)
    ap.add_argument("--stores", default="kvp", help="comma list of kvp, mooncake (default: kvp)")
    a = ap.parse_args(argv)
    stores = a.stores.split(",")
    if set(stores) - {"kvp", "mooncake"}:
        raise SystemExit(f"--stores {a.stores!r}: name kvp and/or mooncake")
    if "mooncake" in stores and not netns.inside():
        return netns.run_inside([str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])])
    from machine import cpu_model

    room = a.objects * SIZE * 2  # segment bytes: twice the data (allocation rounding, no eviction)
    # Mooncake's segment: its puts failed with -200 (no space) at 1.32 M objects in a 1.34 GB segment, so it
    # gets ~1.1 KiB of segment per object (it mounts it without touching it: RSS only where objects land).
    mooncake_room = max(room, a.objects * 1100)
    print(f"CPU: {cpu_model()}; {a.objects:,} objects of {SIZE} bytes, {a.key_bytes}-byte keys, batches of {BATCH}\n")
    print("| store | objects | master RSS growth per object (bytes) | master RSS MiB | client puts/s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="kvp-master-mem-") as d:
        starts = {
            "kvp": lambda: clusters.kvp("tcp", room // 4, Path(d)),
            "mooncake": lambda: clusters.mooncake(mooncake_room // 2, Path(d)),
        }
        for start in (starts[name] for name in stores):
            with start() as target:
                r = measure(target, a.objects, a.key_bytes)
            print(
                f"| {r['store']} | {r['objects']:,} | {r['bytes_per_object']} | {r['master_rss_mib']} | "
                f"{r['puts_per_s']:,} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
