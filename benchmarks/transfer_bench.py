#!/usr/bin/env python3
"""Transfer-core benchmark: batch_write / batch_read between this process and a peer process that exports one
alloc_shared region, per transport (shm, tcp forced), same sizes x batches as store_bench.py. Isolates the
transfer core's cost from the store's (master RPCs), to locate per-op overheads. Each case ends with a read-back
whose xxh3-64 must equal the written bytes.

  .venv/bin/python benchmarks/transfer_bench.py [--sizes 4KiB,1MiB] [--batches 1,32,128] [--iters 200]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from storebench.report import summarize  # noqa: E402
from storebench.workload import BATCHES, SIZES, checksums, fill_random, size_label  # noqa: E402
from kvplugins.config import parse_bytes  # noqa: E402
from kvplugins.transfer import SegmentDescriptor, TransferConfig, TransferEngine, TransferRequest  # noqa: E402


def peer(nbytes: int, transports: str) -> None:
    """Export one shared region, print the descriptor as one JSON line, serve until stdin closes."""
    with TransferEngine(TransferConfig(transports=transports)) as eng:
        eng.alloc_shared(nbytes, export=True)
        print(json.dumps(eng.descriptor().to_wire()), flush=True)
        sys.stdin.read()


def run_transport(transports: str, cases: list[tuple[int, int]], iters: int) -> list[dict]:
    nbytes = max(s * b for s, b in cases)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--peer", str(nbytes), "--transports", transports],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        remote = SegmentDescriptor.from_wire(json.loads(proc.stdout.readline()))
        with TransferEngine(TransferConfig(transports=transports)) as eng:
            src, dst = np.empty(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
            fill_random(src, seed=7)
            regions = eng.register(src), eng.register(dst)
            return [
                row
                for size, batch in cases
                for row in _case(eng, regions, (src, dst), remote, size, batch, iters, transports)
            ]
    finally:
        proc.stdin.close()
        proc.wait(10)


def _case(eng, regions, bufs, remote, size, batch, iters, transports) -> list[dict]:
    rid = remote.regions[0].region_id
    rows = []
    for op, region, call in (("write", regions[0], eng.batch_write), ("read", regions[1], eng.batch_read)):
        reqs = [TransferRequest(region, j * size, remote, rid, j * size, size) for j in range(batch)]
        times = []
        for _ in range(iters + 2):
            t0 = time.perf_counter()
            errs = call(reqs)
            times.append(time.perf_counter() - t0)
            if any(errs):
                raise SystemExit(f"{transports} {op} {size_label(size)}x{batch}: {next(e for e in errs if e)}")
        rows.append(
            {
                "transports": transports,
                "op": op,
                "case": f"{size_label(size)}x{batch}",
                **summarize(times[2:], batch, size * batch),
            }
        )
    if checksums(bufs[0], size, batch) != checksums(bufs[1], size, batch):
        raise SystemExit(f"{transports} {size_label(size)}x{batch}: read-back bytes differ from written bytes")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES[:3]))
    p.add_argument("--batches", default=",".join(str(b) for b in BATCHES))
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--json")
    p.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    p.add_argument("--transports", default="shm,tcp", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer:
        peer(args.peer, args.transports)
        return 0
    cases = [(parse_bytes(s), int(b)) for s in args.sizes.split(",") for b in args.batches.split(",")]
    rows = [r for t in ("shm,tcp", "tcp") for r in run_transport(t, cases, args.iters)]
    print("| transports | case | op | p50 / p99 per batch µs | per op p50 µs | GB/s |\n|---|---|---|---|---|---|")
    for r in rows:
        b = r["batch_us"]
        print(
            f"| {r['transports']} | {r['case']} | {r['op']} | {b['p50']:.1f} / {b['p99']:.1f} | "
            f"{r['op_us']['p50']:.2f} | {r['gbps']:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
