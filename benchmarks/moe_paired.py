"""kvplugins vs torch bf16 in ONE process, in interleaved blocks of forwards: the ratio of their times.

    .venv/bin/python benchmarks/moe_paired.py [--configs bench,dsv2lite] [--tokens 128,512] [--blocks 8]

moe_bench.py runs every backend in its own process, which is fair for threads but not for this 2-core VM's DRAM:
other tenants change the bandwidth a core gets by a third within minutes, so two processes a minute apart can
differ by 15-20% with the same code. Here both backends hold their weights in one process and take turns, one
block of forwards each (the order alternates per block), so both see the same pages and the same neighbours.
Prints, per config and T, each backend's median forward time and the median and range of the per-block ratio
torch/kvplugins (> 1: kvplugins faster). One thread each; kvplugins bf16 through KTMoEWrapper.forward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.moe import backends  # noqa: E402
from benchmarks.moe_bench import experts, routings, touch_all_experts  # noqa: E402


def block_medians(fns, x, routes, blocks):
    """Per backend, the median forward time of each block; blocks alternate which backend goes first."""
    res = {name: [] for name in fns}
    names = list(fns)
    for b in range(blocks):
        for name in names if b % 2 else names[::-1]:
            ts = []
            for ids, w in routes:
                t = time.perf_counter()
                fns[name](x, ids, w)
                ts.append(time.perf_counter() - t)
            res[name].append(statistics.median(ts))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="bench,dsv2lite")
    p.add_argument("--tokens", default="128,512", help="T per forward (comma list)")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--forwards", type=int, default=3, help="forwards per block")
    p.add_argument("--max-experts", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(
        "| config | T | kvplugins bf16 ms | torch bf16 ms | torch/kvplugins per block: median (range) |\n"
        "|---|---|---|---|---|"
    )
    for name in args.configs.split(","):
        E, H, I, K, w, g = experts(name, args.max_experts)
        fns = {"kvplugins": backends.kvplugins_backend("bf16", w, K, 1), "torch": backends.torch_backend(w)}
        for fn in fns.values():
            touch_all_experts(fn, E, H, K)
        for T in (int(t) for t in args.tokens.split(",")):
            routes = routings(T, E, K, args.forwards, seed=T)
            x = torch.randn(T, H, generator=g).to(torch.bfloat16)
            res = block_medians(fns, x, routes, args.blocks)
            ratios = sorted(t / k for t, k in zip(res["torch"], res["kvplugins"]))
            print(
                f"| {name} E={E} | {T} | {statistics.median(res['kvplugins']) * 1e3:.1f} | "
                f"{statistics.median(res['torch']) * 1e3:.1f} | {statistics.median(ratios):.2f} "
                f"({ratios[0]:.2f}-{ratios[-1]:.2f}) |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
