#!/usr/bin/env python3
"""How the master's object table scales (issue #18): RSS per object and batched key-ops/s at N objects.

    .venv/bin/python benchmarks/master_scale.py [--objects 100000,1000000] [--batch 1000] [--key-bytes 48]

Per N, in a fresh child process: one master service (master/service.py, the code the master process runs per
request, here called in process: no sockets, so this is the table's cost, not the RPC path's) with one segment
of 2N x 64 bytes (never above the high watermark: nothing is evicted, checked); N objects of 64 bytes put in batches (put_start + put_commit); then ``exists`` and ``get``
batches of ``--batch`` random stored keys (get both as nested per-key rows and as the column reply clients
ask for). Reports the process RSS growth per object (the native table with its index and LRU lists, and the
allocator's offset map), the table's own byte count, master-side puts/s, and exists / get key-ops/s (best of 5
passes of 20 batches). Keys look like an engine's: a model prefix and a hex block hash (``--key-bytes`` long).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_bytes(pid: int | str = "self", field: str = "VmRSS") -> int:
    """A process's memory from /proc/PID/status in bytes: VmRSS (resident now) or VmHWM (its peak)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def keys(n: int, key_bytes: int) -> list[str]:
    prefix = "llama3-8b/bf16/tp0/"
    width = max(16, key_bytes - len(prefix))
    return [prefix + f"{i * 0x9E3779B97F4A7C15 & (1 << 64) - 1:0{width}x}"[-width:] for i in range(n)]


def measure(n: int, batch: int, key_bytes: int) -> dict:
    from kvplugins.store.config import MasterConfig
    from kvplugins.store.master.service import MasterService

    m = MasterService(MasterConfig(metrics_port=-1, alloc_align=64, heartbeat_timeout_ms=10**9))
    size = 2 * n * 64  # half full at the end: below the high watermark, so nothing is evicted
    wire = {"v": 1, "segment_id": "s", "host_id": "h", "transports": {}, "regions": [[1, size, None]]}
    m.handle("register_segment", [[wire, 1, size]], {})
    ks = keys(n, key_bytes)
    base = rss_bytes()
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        chunk = ks[i : i + batch]
        m.handle("put_start", [[k, 64] for k in chunk], {})
        m.handle("put_commit", chunk, {})
    put_s = time.perf_counter() - t0
    grown = rss_bytes() - base
    if len(m.table) != n:
        raise SystemExit(f"the table holds {len(m.table)} of {n} objects (evicted: {m.counters['evictions']})")
    rng = random.Random(1)
    out = {
        "objects": n,
        "bytes_per_object": round(grown / n),
        "rss_mib": round(rss_bytes() / 2**20),
        "puts_per_s": round(n / put_s),
    }
    for name, op, opts in (("exists", "exists", {}), ("get", "get", {}), ("get_cols", "get", {"cols": 1})):
        best = 0.0
        for _ in range(5):
            batches = [rng.sample(ks, batch) for _ in range(20)]
            t0 = time.perf_counter()
            for b in batches:
                m.handle(op, b, opts)
            best = max(best, 20 * batch / (time.perf_counter() - t0))
        out[f"{name}_key_ops_per_s"] = round(best)
    out["table_bytes_per_object"] = round(m.table.nbytes() / n)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", default="100000,1000000")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--key-bytes", type=int, default=48)
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.child, a.batch, a.key_bytes)))
        return 0
    from benchmarks.machine import cpu_model

    print(f"CPU: {cpu_model()}; batches of {a.batch}; keys of {a.key_bytes} bytes; 64-byte objects\n")
    print(
        "| objects | bytes per object (RSS growth) | of which the native table | process RSS MiB | master puts/s "
        "| exists key-ops/s | get key-ops/s | get (cols) key-ops/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in a.objects.split(",")):
        r = json.loads(
            subprocess.run(
                [sys.executable, __file__, "--child", str(n), "--batch", str(a.batch), "--key-bytes", str(a.key_bytes)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        print(
            f"| {n:,} | {r['bytes_per_object']} | {r['table_bytes_per_object']} | {r['rss_mib']} | "
            f"{r['puts_per_s']:,} | {r['exists_key_ops_per_s']:,} | {r['get_key_ops_per_s']:,} | "
            f"{r['get_cols_key_ops_per_s']:,} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
