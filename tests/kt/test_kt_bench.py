"""benchmarks/moe_bench.py still runs end to end: a tiny shape, kvplugins' three formats and torch, each backend in
its own process, as the real benchmark does (kt-kernel is left out: it is optional and slow to load). Speed is
not asserted here; the table must come out complete, with a number in every decode/prefill cell."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_moe_bench_runs_on_a_tiny_shape():
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "moe_bench.py"),
        "--configs",
        "tiny",
        "--no-kt",
        "--threads",
        "1",
        "--cpu-time",
        "--decode-iters",
        "3",
        "--prefill-iters",
        "1",
        "--bw-gib",
        "0.03125",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln.split("|")[1:-1] for ln in r.stdout.splitlines() if ln.startswith("| tiny")]
    backends = {c[1].strip() for c in rows}
    assert backends == {"kvplugins bf16", "kvplugins int8", "kvplugins int4", "torch bf16"}, r.stdout
    assert len(rows) == 4 * 4  # T = 1, 4, 128, 512 per backend
    for c in rows:
        assert float(c[3]) > 0  # ms per forward
        if int(c[2]) <= 4:
            assert float(c[4]) > 0 and c[5].strip().endswith("%")  # GB/s and % of read bandwidth
        assert float(c[6]) > 0  # GFLOP/s


def test_moe_paired_runs_on_a_tiny_shape():
    """benchmarks/moe_paired.py (kvplugins and torch interleaved in one process) prints one row per T, with
    positive times and a ratio."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "moe_paired.py"),
        "--configs",
        "tiny",
        "--tokens",
        "4,16",
        "--blocks",
        "2",
        "--forwards",
        "1",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln.split("|")[1:-1] for ln in r.stdout.splitlines() if ln.startswith("| tiny")]
    assert [int(c[1]) for c in rows] == [4, 16], r.stdout
    for c in rows:
        assert float(c[2]) > 0 and float(c[3]) > 0 and float(c[4].split()[0]) > 0
