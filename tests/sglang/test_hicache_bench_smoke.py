"""Smoke test of benchmarks/hicache_bench.py (kvplugins + SGLang's file backend; Mooncake needs root and a netns),
run in this process (SGLang is already imported here): every row ran and every page read back equal to what was
written. Speed is not asserted (benchmarks prove it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers.installed import require

require("sglang", "bash ci/install-sglang.sh")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import hicache_bench  # noqa: E402


def test_bench_runs_every_backend_and_verifies_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "")  # the bench sets it; undone after
    out = tmp_path / "hicache.json"
    rc = hicache_bench.main(
        [
            "--no-mooncake",
            "--pages",
            "2",
            "--rounds",
            "1",
            "--warmup",
            "1",
            "--layouts",
            "layer_first",
            "--json",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["layout"], r["backend"]) for r in rows} == {
        ("layer_first", b) for b in ("kvp-shm", "kvp-tcp", "file", "file-cold")
    }
    assert all(r.get("verified") is True and r["set_GBps"] > 0 and r["get_GBps"] > 0 for r in rows), rows
