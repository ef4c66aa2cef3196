#!/usr/bin/env python3
"""Put latency in a full pool: one client puts fresh 4 KiB objects until the pool has turned over a few times,
so the master evicts as it goes (watermark sweeps, docs/store.md "Eviction"). Reports, per window of puts, the
per-put latency p50 / p99 / max and how many puts took over 5 ms: a stall of the master shows as a max and a
count, not in the median.

    .venv/bin/python benchmarks/put_churn.py [--segment-mib 64] [--puts 40000] [--window 5000] [--grace-ms 1000]

A real ``kvplugins master`` and one ``kvplugins store`` node with one segment on loopback (tests/helpers/cluster.py),
the client's puts one object each (``StoreClient.put``, the one-round-trip slab put while the pool has room for a
slab). ``--grace-ms``: the master's eviction_grace_ms (an object younger than that is never evicted; the default
lease_ttl_ms, 5 s, is longer than this client takes to fill a 64 MiB segment, and then puts answer StoreFull).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from machine import cpu_model  # noqa: E402

SLOW_S = 0.005


def run(segment_mib: int, puts: int, window: int, grace_ms: int) -> list[dict]:
    from helpers.cluster import store_cluster

    from kvplugins.store.client import StoreClient
    from kvplugins.store.config import ClientConfig

    data, rows, lat = b"x" * 4096, [], []
    with store_cluster(nodes=1, segment_size=f"{segment_mib}MiB", master_flags={"eviction_grace_ms": grace_ms}) as c:
        with StoreClient(ClientConfig(master=c.master)) as client:
            for i in range(puts):
                t0 = time.perf_counter()
                client.put(f"churn/{i}", data)
                lat.append(time.perf_counter() - t0)
                if len(lat) == window:
                    lat.sort()
                    rows.append(
                        {
                            "puts": f"{i + 1 - window}-{i + 1}",
                            "filled": round((i + 1) * len(data) / (segment_mib << 20), 2),
                            "p50_us": round(statistics.median(lat) * 1e6),
                            "p99_us": round(lat[int(0.99 * len(lat))] * 1e6),
                            "max_ms": round(lat[-1] * 1e3, 1),
                            "slow": sum(1 for x in lat if x > SLOW_S),
                        }
                    )
                    lat = []
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segment-mib", type=int, default=64)
    ap.add_argument("--puts", type=int, default=40000)
    ap.add_argument("--window", type=int, default=5000)
    ap.add_argument("--grace-ms", type=int, default=1000)
    a = ap.parse_args(argv)
    rows = run(a.segment_mib, a.puts, a.window, a.grace_ms)
    print(f"CPU: {cpu_model()}; one {a.segment_mib} MiB segment, 4 KiB puts, eviction grace {a.grace_ms} ms\n")
    print("| puts | pool turned over | p50 µs | p99 µs | max ms | puts > 5 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['puts']} | {r['filled']}x | {r['p50_us']} | {r['p99_us']} | {r['max_ms']} | {r['slow']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
