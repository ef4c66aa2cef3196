"""Smoke test of benchmarks/te_bench.py --quick: ours (TCP only and default) and the real Mooncake 0.3.13 wheel's
Transfer Engine side by side in one private network namespace; every row ran, with bytes checked per case. Speed
itself is not asserted (benchmarks prove speed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_reports_every_row(tmp_path):
    pytest.importorskip("mooncake.engine")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("the real wheel binds 0.0.0.0: it runs in a private network namespace (root, unshare)")
    out = tmp_path / "te.json"
    proc = subprocess.run(
        ["unshare", "-n", sys.executable, str(REPO / "benchmarks" / "te_bench.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["case"], r["op"]) for r in rows} == {
        (c, op) for c in ("4KiBx1", "4KiBx128", "1MiBx32") for op in ("read", "write")
    }
    assert all(set(r["us"]) == {"ours-tcp", "ours", "mooncake-tcp"} and min(r["us"].values()) > 0 for r in rows)
    assert "| 4KiBx1 | read |" in proc.stdout
