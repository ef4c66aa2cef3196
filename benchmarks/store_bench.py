#!/usr/bin/env python3
"""Store benchmark (issue #2): put and get across processes (a writer and a different reader process), zero-copy
on registered buffers, for object sizes 4 KiB .. 16 MiB in batches of 1, 32 and 128. Our store runs with the shm
transport and with TCP forced; ``--vs mooncake`` adds Mooncake's store over TCP in the same run, everything inside
a private network namespace. Every get is checked byte for byte (xxh3-64 per object) against the writer. Each
case also measures two floors in the same run: memcpy and a plain C loopback TCP connection (storebench/baselines.py).

  .venv/bin/python benchmarks/store_bench.py                       # our store, shm and tcp
  .venv/bin/python benchmarks/store_bench.py --vs mooncake --json .bench/store.json
  .venv/bin/python benchmarks/store_bench.py --quick               # smoke run (seconds)
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from storebench import baselines, clusters, netns, workload  # noqa: E402
from storebench.driver import BytesMismatch, Session  # noqa: E402
from storebench.procs import WorkerFailed  # noqa: E402
from storebench.report import ratios, tables, targets  # noqa: E402
from kvplugins.config import parse_bytes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vs", choices=("none", "mooncake"), default="none", help="also run Mooncake (TCP), side by side")
    p.add_argument(
        "--ours",
        default="shm,tcp",
        help="our transport modes to run, comma-separated: shm, tcp (both: shm,tcp), or '' for none",
    )
    p.add_argument("--quick", action="store_true", help="short smoke run: 4KiB and 1MiB, batches 1 and 32, few iters")
    p.add_argument("--sizes", help="object sizes, e.g. 4KiB,64KiB,1MiB,16MiB")
    p.add_argument("--batches", help="batch sizes, e.g. 1,32,128")
    p.add_argument(
        "--max-batch-bytes",
        default="512MiB",
        help="skip cases above this many bytes per batch "
        "(default 512MiB: 16MiB x 128 = 2GiB is skipped; each store then needs ~3x that in RAM)",
    )
    p.add_argument("--bytes-per-case", default="2GiB", help="iterations per case ~ this / batch bytes")
    p.add_argument("--min-iters", type=int, default=10)
    p.add_argument("--max-iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=3, help="untimed (but verified) rounds per case")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="run the stores one after another instead of "
        "interleaved case by case (less memory: one store at a time; ratios more exposed to load drift)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any worker may take to answer")
    p.add_argument("--json", help="write machine-readable results here")
    p.add_argument("--log-dir", help="worker and server logs (default .bench/logs-<pid>)")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = args.sizes or "4KiB,1MiB"
        args.batches = args.batches or "1,32"
        args.bytes_per_case, args.min_iters, args.max_iters, args.warmup = "16MiB", 3, 20, 1
    return args


def build_cases(args) -> list[workload.Case]:
    sizes = [parse_bytes(s) for s in args.sizes.split(",")] if args.sizes else workload.SIZES
    batches = [int(b) for b in args.batches.split(",")] if args.batches else workload.BATCHES
    if min(sizes) < 32:
        raise SystemExit(f"--sizes: {min(sizes)} bytes is too small; objects must be >= 32 bytes (stamped ends)")
    return workload.plan(
        sizes,
        batches,
        parse_bytes(args.max_batch_bytes),
        parse_bytes(args.bytes_per_case),
        args.min_iters,
        args.max_iters,
        args.warmup,
    )


def _targets(args, max_batch: int, log_dir: Path):
    """Cluster starters, in run order; each sizes its segment for ``max_batch`` bytes per batch."""
    modes = [m for m in args.ours.split(",") if m]
    for m in modes:
        if m not in clusters.KVP_MODES:
            raise SystemExit(f"--ours: unknown mode {m!r}; use shm, tcp or shm,tcp")
    for m in modes:
        yield lambda m=m: clusters.kvp(m, max_batch, log_dir)
    if args.vs == "mooncake":
        yield lambda: clusters.mooncake(max_batch, log_dir)


def run_all(args, cases, log_dir: Path) -> dict:
    """All stores interleaved case by case (default), or one store after another with --sequential."""
    starters = list(_targets(args, max(c.batch_bytes for c in cases if not c.skipped), log_dir))
    groups = [[s] for s in starters] if args.sequential else [starters]
    rows, stats, errors = [], {}, []
    for group in groups:
        got, st = run_group(group, cases, log_dir, args.timeout, errors)
        rows += got
        stats.update(st)
    return {"rows": rows, "ratios": ratios(rows), "targets": targets(rows), "stats": stats, "errors": errors}


def run_group(starters, cases, log_dir: Path, timeout_s: float, errors: list[str]) -> tuple[list[dict], dict]:
    """Start every store of the group, prefault each, then run case by case over the stores. A store that fails
    is recorded in ``errors`` and dropped; the others go on."""
    biggest = max((c for c in cases if not c.skipped), key=lambda c: c.batch_bytes)
    rows, stats = [], {}
    with contextlib.ExitStack() as stack:
        sessions = []
        for start in starters:
            with _recorded(errors):
                target = stack.enter_context(start())
                session = stack.enter_context(
                    contextlib.closing(Session(target, biggest.batch_bytes, log_dir, timeout_s))
                )
                session.prefault(biggest)
                sessions.append(session)
        for case in cases:
            _say(
                f"-- {case.name}: {case.skipped or f'{case.iters} rounds'} on "
                f"{', '.join(s.target.label for s in sessions)}"
            )
            for session in list(sessions):
                if not _recorded_call(errors, lambda: rows.extend(session.run_case(case))):
                    sessions.remove(session)
            rows.extend(baselines.rows(case))
        for session in sessions:
            _recorded_call(errors, lambda: stats.update({session.target.label: session.stats()}))
    return rows, stats


@contextlib.contextmanager
def _recorded(errors: list[str]):
    try:
        yield
    except (WorkerFailed, BytesMismatch) as e:
        errors.append(f"{type(e).__name__}: {e}")
        _say(f"!! {errors[-1]}")


def _recorded_call(errors: list[str], fn) -> bool:
    n = len(errors)
    with _recorded(errors):
        fn()
    return len(errors) == n


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _git_rev() -> str | None:
    """HEAD of the checkout, with "+dirty" if tracked files differ from it (the run measured the work tree)."""
    import subprocess

    try:
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", "kvplugins"]).returncode
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def meta(argv: list[str]) -> dict:
    import importlib.metadata as md

    def version(dist: str) -> str | None:
        with contextlib.suppress(md.PackageNotFoundError):
            return md.version(dist)
        return None

    return {
        "command": shlex.join(["python", "benchmarks/store_bench.py", *argv]),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "kvplugins": version("kvplugins"),
        "git": _git_rev(),
        "mooncake": version("mooncake-transfer-engine-non-cuda"),
        "netns": os.environ.get(netns.ENV),
        "loadavg_at_start": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt as e:
        print(f"store_bench: interrupted ({e or 'SIGINT'}); every server and worker was stopped", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.vs == "mooncake" and not netns.inside():
        return netns.run_inside([str(Path(__file__).resolve()), *argv])
    netns.interrupt_on_signals()  # a kill still stops every server and worker this run started
    cases = build_cases(args)
    log_dir = Path(args.log_dir or REPO / ".bench" / f"logs-{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta(argv), **run_all(args, cases, log_dir)}
    verified = [r for r in result["rows"] if not r["skipped"]]
    result["meta"]["loadavg_at_end"] = os.getloadavg()
    result["verified"] = {
        "objects": sum(r["verified_objects"] for r in verified if r["op"] == "get"),
        "bytes": sum(r["verified_bytes"] for r in verified if r["op"] == "get"),
        "mismatches": sum("BytesMismatch" in e for e in result["errors"]),
    }
    print(tables(result["rows"]))
    m = result["meta"]
    print(
        f"\nload average (1 min) at start {m['loadavg_at_start'][0]:.2f}, at end {m['loadavg_at_end'][0]:.2f}; "
        f"{m['cpus']} CPUs; kvplugins {m['git']}"
    )
    print(
        f"verified: {result['verified']['objects']} objects, {result['verified']['bytes']:,} bytes read back "
        f"equal to what was written; logs in {log_dir}"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    for e in result["errors"]:
        print(f"ERROR {e}", file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
