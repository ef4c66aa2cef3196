"""Smoke test of benchmarks/hicache_bench.py (kvplugins + SGLang's file backend; Mooncake needs root and a netns):
every row ran and every page read back equal to what was written. Speed is not asserted (benchmarks prove it)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_runs_every_backend_and_verifies_bytes(tmp_path):
    out = tmp_path / "hicache.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "hicache_bench.py"), "--no-mooncake",
                           "--pages", "2", "--rounds", "1", "--layouts", "layer_first",
                           "--json", str(out), "--log-dir", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["layout"], r["backend"]) for r in rows} == {
        ("layer_first", b) for b in ("kvp-shm", "kvp-tcp", "file", "file-cold")}
    assert all(r.get("verified") is True and r["set_GBps"] > 0 and r["get_GBps"] > 0 for r in rows), rows
