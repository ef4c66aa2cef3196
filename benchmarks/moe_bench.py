"""CPU MoE expert backends side by side in one run: kvplugins (this repo), kt-kernel 0.7.2 and torch bf16.

    bash ci/install-kt.sh        # kt-kernel 0.7.2 into .venv/kt-kernel-0.7.2 (benchmark only)
    .venv/bin/python benchmarks/moe_bench.py [--threads N] [--configs bench,dsv2lite,qwen3] [--max-experts E]
        [--cpu-time] [--rounds R] [--isas auto|avx512_bf16,avx512,avx2]

``--isas``: one kvplugins row per kernel tier named (forced through KVPLUGINS_KT_ISA in that backend's process;
"auto" = the widest this CPU runs), so every tier this CPU has is measured beside kt-kernel in the same run.
Each table names the CPU model (/proc/cpuinfo) and the tier auto picks, and why.

Decode (T=1, 4): GB/s of expert weights touched (unique experts routed x their bytes) and the share of this
machine's read bandwidth, measured in the same run (torch.sum over fp32 with the same thread count and the same
clock as the forwards, best of 5 at the start and in every backend's process; the best of all is the
denominator). Prefill (T=128, 512): GFLOP/s (T x K x 3 x 2 x H x I per forward). Times are medians per
forward. Routing is uniform random, new per iteration, so decode reads weights from DRAM (they are far larger than
the caches). Each backend runs alone in its own process. "idle CPU" is what that process burns in the second
after its last forward. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.moe import backends  # noqa: E402
from machine import cpu_model

CONFIGS = {  # name: (E, H, I, top-k)
    "bench": (64, 2048, 768, 8),
    "dsv2lite": (64, 2048, 1408, 6),  # DeepSeek-V2-Lite
    "qwen3": (128, 2048, 768, 8),  # Qwen3-30B-A3B
    "tiny": (8, 256, 128, 2),  # smoke test only (tests/kt/test_kt_bench.py)
}
DECODE_T, PREFILL_T = (1, 4), (128, 512)


def read_bandwidth(threads: int, gib: float = 1.0, clock=time.perf_counter) -> float:
    """Bytes/s that torch.sum reads with `threads` threads (best of 5), timed by the same clock as the forwards:
    with --cpu-time a wall-clock probe would count time the probe spent descheduled and flatter the backends."""
    torch.set_num_threads(threads)
    a = torch.ones(int(gib * (1 << 30)) // 4)
    best = 0.0
    for _ in range(5):
        t = clock()
        a.sum()
        best = max(best, a.numel() * 4 / max(clock() - t, 1e-9))
    return best


def _clock(args):
    return time.process_time if args.cpu_time else time.perf_counter


def experts(name: str, max_experts: int = 0):
    """(E, H, I, K, (gate [E, I, H], up [E, I, H], down [E, H, I]) bf16, generator) for config ``name``, E capped
    at ``max_experts`` (0: none); the same seeded weights for every backend, and the generator for the inputs."""
    E, H, I, K = CONFIGS[name]
    E = min(E, max_experts) if max_experts else E
    g = torch.Generator().manual_seed(1)
    w = tuple((torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16) for s in ((E, I, H), (E, I, H), (E, H, I)))
    return E, H, I, K, w, g


def routings(T, E, K, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=g)
        out.append((ids, w / w.sum(1, keepdim=True)))
    return out


def time_fn(fn, x, routes, warmup=2, clock=time.perf_counter):
    """Median seconds per forward: the machine is shared, and a median ignores the bursts of other work."""
    for ids, w in routes[:warmup]:
        fn(x, ids, w)
    times = []
    for ids, w in routes[warmup:]:
        t = clock()
        fn(x, ids, w)
        times.append(clock() - t)
    return sorted(times)[len(times) // 2]


def touch_all_experts(fn, E, H, K):
    """One forward that routes every expert once, so no timed forward pays a first touch of an expert's weights
    (page-table fills, pages moved by compaction while the machine is short of memory): a server's experts are
    all warm. The same for every backend."""
    T = -(-E // K)
    ids = (torch.arange(T * K) % E).reshape(T, K)
    fn(torch.randn(T, H).to(torch.bfloat16), ids, torch.full((T, K), 1.0 / K))


def build(label, fmt, w, K, threads):
    if label.startswith("kvplugins"):
        if "@" in label:  # a forced tier ("kvplugins int8 @avx512"), read by the wrapper's KTConfig
            os.environ["KVPLUGINS_KT_ISA"] = label.split("@")[1]
        return backends.kvplugins_backend(fmt, w, K, threads)
    if label.startswith("kt-kernel"):
        return backends.kt_backend(fmt, w, K, threads, 0)
    return backends.torch_backend(w)


def idle_cpu(seconds=1.0) -> float:
    """CPU seconds per second this process burns while nothing is submitted (kt-kernel issue #1836)."""
    import resource

    time.sleep(0.1)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    time.sleep(seconds)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / (time.perf_counter() - t0)


def worker(name, label, fmt, args) -> dict:
    """One backend on one config, alone in this process (no other backend's threads compete)."""
    E, H, I, K, w, g = experts(name, args.max_experts)
    bw = read_bandwidth(args.threads, args.bw_gib / 2, _clock(args))  # the machine may be quieter than at start
    torch.set_num_threads(args.threads)
    fn = build(label, fmt, w, K, args.threads)
    touch_all_experts(fn, E, H, K)
    rows = []
    for T in DECODE_T + PREFILL_T:
        n = args.decode_iters if T in DECODE_T else args.prefill_iters
        routes = routings(T, E, K, n + 2, seed=T)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        dt = time_fn(fn, x, routes, clock=_clock(args))
        touched = sum(len(ids.unique()) for ids, _ in routes[2:]) / n
        gbs = backends.weight_bytes(fmt, touched, H, I) / dt / 1e9
        dec = T in DECODE_T
        rows.append(
            [
                f"{name} E={E}",
                label,
                T,
                f"{dt * 1e3:.2f}",
                float(f"{gbs:.3g}") if dec else "",  # 3 significant figures: a tiny shape reads < 0.05 GB/s
                "",
                _gflops(T * K * 6 * H * I / dt / 1e9),
            ]
        )
    idle = f"{100 * idle_cpu():.0f}%"
    return {"bw": bw, "rows": [r + [idle] for r in rows]}


def run_isolated(name, label, fmt, args) -> dict:
    import json
    import subprocess

    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        f"{name}|{label}|{fmt}",
        "--threads",
        str(args.threads),
        *(["--cpu-time"] if args.cpu_time else []),
        "--max-experts",
        str(args.max_experts),
        "--bw-gib",
        str(args.bw_gib),
        "--decode-iters",
        str(args.decode_iters),
        "--prefill-iters",
        str(args.prefill_iters),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    last = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith('{"bw"')), "")  # kt-kernel prints too
    if r.returncode != 0 or not last:
        err = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"bw": 0.0, "rows": [[name, label, "-", f"unavailable: {err}"[:90], "", "", "", ""]]}
    return json.loads(last)


def _gflops(g: float) -> str:
    """Whole GFLOP/s, with decimals under 10 (a tiny shape on a loaded machine must not print 0)."""
    return f"{g:.0f}" if g >= 10 else f"{g:.3f}"


def median_row(by_round):
    """The row (one T of one backend) whose ms is the median over the rounds; failed rounds are ignored."""
    ok = sorted((r for r in by_round if r[2] != "-"), key=lambda r: float(r[3]))
    return ok[(len(ok) - 1) // 2] if ok else by_round[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--configs", default="bench,dsv2lite,qwen3")
    p.add_argument("--formats", default="bf16,int8,int4")
    p.add_argument("--max-experts", type=int, default=0, help="cap E (memory); 0 = the model's")
    p.add_argument("--decode-iters", type=int, default=30)
    p.add_argument("--prefill-iters", type=int, default=3)
    p.add_argument("--no-kt", action="store_true", help="skip kt-kernel")
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="time forwards by process CPU time, not wall time (per-core efficiency on a busy machine; "
        "use with --threads 1)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every backend this many times, interleaved; each cell reports the round with the median time",
    )
    p.add_argument("--bw-gib", type=float, default=1.0, help="GiB the read-bandwidth probe sums (workers: half)")
    p.add_argument("--isas", default="auto", help="kvplugins kernel tiers to run, e.g. avx512_bf16,avx512,avx2")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.formats = args.formats.split(",")
    if args.worker:
        import json

        print(json.dumps(worker(*args.worker.split("|"), args)))
        return 0
    bw = read_bandwidth(args.threads, args.bw_gib, _clock(args))
    from kvplugins.kt_expert_backend import native

    print(
        f"CPU: {cpu_model()}; kvplugins tiers here: {', '.join(native.supported_isas())}; auto picks "
        f"{native.describe_isa()}",
        flush=True,
    )
    print(
        f"read bandwidth (torch.sum, {args.threads} threads): {bw / 1e9:.1f} GB/s; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    runs = {}  # (config, backend) -> one result per round
    for rnd in range(args.rounds):  # rounds interleave the backends: a burst of load hits one round, not one backend
        for name in args.configs.split(","):
            cands = []
            for fmt in args.formats:
                for isa in args.isas.split(","):
                    cands.append((f"kvplugins {fmt}" + ("" if isa == "auto" else f" @{isa}"), fmt))
                if not args.no_kt:
                    cands.append((f"kt-kernel {backends.METHODS[fmt]}", fmt))
            cands.append(("torch bf16", "bf16"))
            for label, fmt in cands:
                res = run_isolated(name, label, fmt, args)
                bw = max(bw, res["bw"])
                runs.setdefault((name, label), []).append(res["rows"])
                for r in res["rows"]:
                    print(f"round {rnd + 1}: " + " | ".join(map(str, r)), flush=True)
    rows = []
    for results in runs.values():
        good = [r for r in results if r[0][2] != "-"] or results[:1]  # a failed round has one "unavailable" row
        rows += [median_row(by_round) for by_round in zip(*good)]
    print(
        "\n| config | backend | T | ms | GB/s | % of read BW | GFLOP/s | idle CPU |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        if r[4] != "":
            r[5] = f"{100 * r[4] * 1e9 / bw:.0f}%"
        print("| " + " | ".join(map(str, r)) + " |")
    print(
        f"\nread bandwidth: best torch.sum over this run, {args.threads} threads: {bw / 1e9:.1f} GB/s; "
        f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
