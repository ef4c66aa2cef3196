"""The Conductor vs the other routing policies on a trace (issue #37): ``kvplugins replay``'s TTFT model (a
simulated clock over the trace's arrivals, FIFO instances, kvplugins/router/cost.py) with the real store as the
shared pool, every policy at every load on the same clock. Per (load, policy): TTFT p50/p99, the share of all
requests served within the SLO, goodput (requests within it per simulated second), rejections, hit ratio.

    .venv/bin/python benchmarks/conductor_bench.py [--trace ../shared/traces/mooncake_conversation_trace.jsonl]
        [--speeds 1,2] [--instances 8] [--local 1000] [--pool 20000] [--prefill-tok-s 8000] [--slo-ms 5000]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("round_robin", "session", "prefix_aware", "conductor")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--speeds", default="1,2", help="loads: the trace's clock runs this many times faster")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--local", default="1000", help="each instance's own cache (blocks)")
    ap.add_argument("--pool", default="20000", help="the shared pool (blocks)")
    ap.add_argument("--prefill-tok-s", type=float, default=8000.0)
    ap.add_argument("--load-gbps", type=float, default=20.0)
    ap.add_argument("--slo-ms", type=float, default=5000.0)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from kvplugins.replay.config import ReplayConfig
    from kvplugins.replay.plan import execute

    rows = []
    for speed in [float(s) for s in args.speeds.split(",")]:
        for policy in POLICIES:
            cfg = ReplayConfig(
                instances=args.instances, local_capacity=args.local, pool_capacity=args.pool, routing=policy,
                prefill_tok_s=args.prefill_tok_s, load_gbps=args.load_gbps, speed=speed, slo_ttft_ms=args.slo_ms,
                limit=args.limit, progress=False,
            )  # fmt: skip
            [row] = execute(cfg, args.trace, say=lambda s: None)
            rows.append({"speed": speed, "policy": policy, **row})
            print(json.dumps({k: rows[-1][k] for k in ("speed", "policy", "goodput_rps", "rejected")}), file=sys.stderr)
    print(f"CPU: {cpu_model()}; {Path(args.trace).name}, {args.instances} instances, own caches {args.local} blocks, "
          f"pool {args.pool} blocks, {args.prefill_tok_s:g} prefill tok/s, {args.load_gbps:g} GB/s, SLO {args.slo_ms:g} ms")  # fmt: skip
    print("| load | policy | TTFT p50 / p99 (ms) | within SLO | goodput (req/s) | rejected | hit ratio |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        t = r["ttft_ms"]
        print(
            f"| {r['speed']:g}x | {r['policy']} | {t.get('p50', 0):,.0f} / {t.get('p99', 0):,.0f} | "
            f"{r['within_slo']:.1%} | {r['goodput_rps']:.2f} | {r['rejected']} | {r['hit_ratio']:.3f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
