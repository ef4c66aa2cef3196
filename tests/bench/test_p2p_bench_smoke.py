"""Smoke test of benchmarks/p2p_bench.py: a small checkpoint from one publisher to 1 and 2 receivers over shaped
links in network namespaces, P2P and the publisher-only baseline; every row ran and every receiver's files equal
the published ones. Speed itself is not asserted (benchmarks prove speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_small_run_reports_every_row_with_the_files_verified(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("namespaces and tc need root")
    out = tmp_path / "p2p.json"
    argv = ["--receivers", "1,2", "--size", "4MiB", "--chunk", "256KiB", "--rate", "100mbit", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "p2p_bench.py"), *argv, "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["mode"], r["receivers"]) for r in rows} == {(m, n) for m in ("peers", "owner") for n in (1, 2)}
    assert all(r["verified"] and 0 < r["slowest_pull_s"] <= r["t_all_s"] for r in rows)
    assert "| 2 |" in proc.stdout and not list(tmp_path.glob("kvp-p2p-bench-*"))
