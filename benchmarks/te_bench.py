#!/usr/bin/env python3
"""Mooncake Transfer Engine API benchmark (issue #36): ours (kvplugins.mooncake.te over kvplugins.transfer) vs the
real Mooncake 0.3.13 wheel, both through ``mooncake.engine``'s API, in one run: a driver process reads from and
writes to a peer process's registered buffer with ``batch_transfer_sync_read`` / ``_write``, P2PHANDSHAKE on
loopback. Rows: ours over TCP only (KVPLUGINS_TRANSFER_TRANSPORTS=tcp), ours as configured by default (same
host: shared memory / cma), Mooncake's TCP transport. Cases interleaved case by case, so load changes hit all
alike; medians of per-batch wall time, bytes checked once per case.

  unshare -n .venv/bin/python benchmarks/te_bench.py [--json out.json] [--quick]  (root: the wheel binds 0.0.0.0)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from machine import cpu_model

CASES = ((4096, 1, 400), (4096, 128, 100), (1 << 20, 32, 30))  # (object bytes, batch, iterations)
PEER_BYTES = 64 << 20


def engine_module(impl: str):
    if impl == "real":
        from mooncake import engine
    else:
        from kvplugins.mooncake import te as engine
    return engine


def peer(impl: str) -> None:
    """Register PEER_BYTES of a pattern, print its port and address, serve until stdin closes."""
    e = engine_module(impl).TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = (np.arange(PEER_BYTES, dtype=np.uint64) % 251).astype(np.uint8)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    print(json.dumps({"port": e.get_rpc_port(), "addr": buf.ctypes.data}), flush=True)
    sys.stdin.read()


class Side:
    """One driver engine and its peer: ``run(op, size, batch)`` times one batch."""

    def __init__(self, label: str, impl: str, env: dict[str, str]):
        self.label = label
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--peer", impl], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        info = json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]
        self.name, self.raddr = f"127.0.0.1:{info['port']}", info["addr"]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self.e = engine_module(impl).TransferEngine()
            assert self.e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        self.buf = np.zeros(PEER_BYTES, dtype=np.uint8)
        assert self.e.register_memory(self.buf.ctypes.data, self.buf.nbytes) == 0

    def run(self, op: str, size: int, batch: int) -> float:
        la, ra = self.buf.ctypes.data, self.raddr
        locs, rems = [la + i * size for i in range(batch)], [ra + i * size for i in range(batch)]
        fn = self.e.batch_transfer_sync_read if op == "read" else self.e.batch_transfer_sync_write
        t0 = time.perf_counter()
        rc = fn(self.name, locs, rems, [size] * batch)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise SystemExit(f"{self.label} {op} {size}x{batch}: rc {rc}")
        return dt

    def check(self, size: int, batch: int) -> None:
        self.buf[: size * batch] = 0
        self.run("read", size, batch)
        want = (np.arange(size * batch, dtype=np.uint64) % 251).astype(np.uint8)
        if not np.array_equal(self.buf[: size * batch], want):
            raise SystemExit(f"{self.label}: wrong bytes read for {size}x{batch}")

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=30)


def _size(n: int) -> str:
    return f"{n >> 20}MiB" if n >= 1 << 20 else f"{n >> 10}KiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--quick", action="store_true", help="a tenth of the iterations (a smoke run)")
    args = p.parse_args()
    if args.peer:
        return peer(args.peer)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    sides = [
        Side("ours-tcp", "ours", {"KVPLUGINS_TRANSFER_TRANSPORTS": "tcp"}),
        Side("ours", "ours", {}),
        Side("mooncake-tcp", "real", {}),
    ]
    rows = []
    try:
        for size, batch, iters in CASES:
            iters = max(3, iters // 10) if args.quick else iters
            for s in sides:
                s.check(size, batch)
            for op in ("read", "write"):
                times: dict[str, list[float]] = {s.label: [] for s in sides}
                for _ in range(iters):
                    for s in sides:
                        times[s.label].append(s.run(op, size, batch))
                med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
                rows.append({"case": f"{_size(size)}x{batch}", "op": op, "us": med})
    finally:
        for s in sides:
            s.close()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; medians, µs per batch")
    print("| case | op | ours tcp | ours (same host) | Mooncake tcp | ours tcp vs Mooncake | ours vs Mooncake |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        u = r["us"]
        print(
            f"| {r['case']} | {r['op']} | {u['ours-tcp']:.0f} | {u['ours']:.0f} | {u['mooncake-tcp']:.0f} | "
            f"{u['mooncake-tcp'] / u['ours-tcp']:.2f}x | {u['mooncake-tcp'] / u['ours']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
