#!/usr/bin/env python3
"""The whole FAST'25 conversation trace through the real store at 8 instances (issue #17).

    .venv/bin/python benchmarks/replay_bench.py [--trace ../shared/traces/mooncake_conversation_trace.jsonl]
        [--capacities 10000,20000,50000] [--local 1000] [--plot docs/img/replay_conversation.png]

Per pool capacity (blocks of 512 tokens; llama3-8b shape, objects scaled to 4 KiB): a global pool (private
embedded store), 8 per-instance LRU caches of capacity/8 each (round robin), and both tiers (--local blocks per
instance in front of the pool). Prints a markdown table: our hit ratio next to a plain prefix-LRU of the same
capacity, and the store's sustained puts/s and gets/s over the replay (as fast as possible, one client).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.machine import cpu_model  # noqa: E402

from kvplugins.replay.config import ReplayConfig  # noqa: E402
from kvplugins.replay.plan import execute  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"))
    p.add_argument("--capacities", default="10000,20000,50000")
    p.add_argument("--local", default="1000", help="blocks per instance in the both-tiers configuration")
    p.add_argument("--plot", default="")
    p.add_argument("--json", default="")
    a = p.parse_args()
    cfg = ReplayConfig(sweep=a.capacities, instances=8, local_capacity=a.local, plot=a.plot, json=a.json)
    rows = execute(cfg, a.trace, say=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; trace {Path(a.trace).name}, {rows[0]['requests']:,} requests\n")
    print("| configuration | pool blocks | hit ratio | reference LRU | difference (points) | puts/s | gets/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ref = r["reference_lru_hit_ratio"]
        diff = "-" if ref is None else f"{100 * (r['hit_ratio'] - ref):+.1f}"
        cap = r["pool_blocks"] or r["local_blocks_per_instance"] * r["instances"]
        print(
            f"| {r['config']} | {cap:,} | {r['hit_ratio']:.3f} | {'-' if ref is None else f'{ref:.3f}'} | {diff} "
            f"| {r['puts_per_s'] or '-'} | {r['gets_per_s'] or '-'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
