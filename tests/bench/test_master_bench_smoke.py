"""Smoke tests of the master's scale benchmarks (issue #18) at small counts, so they keep running: master_memory.py
against a real `kvplugins master` + store node (ours only: Mooncake needs root and a network namespace) and
master_recovery.py against a real etcd (a fill through the leader's journal, then load + restore in a fresh
process, which must recover every object); also auth_cost.py (issue #30) against a real master and node. Speed
is not asserted (benchmarks prove speed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))


def _rows(out: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.splitlines()
        if re.match(r"^\| [\w-]*[\d,]+ ", line) or line.startswith("| kvp")
    ]


def test_master_memory_reports_our_master():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "master_memory.py"), "--objects", "20000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [row] = _rows(proc.stdout)
    assert row[0] == "kvp-tcp" and row[1] == "20,000" and int(row[2]) > 0 and int(row[4].replace(",", "")) > 0


def test_master_recovery_recovers_every_object():
    from helpers.etcd import etcd_binary

    try:
        etcd_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "master_recovery.py"), "--objects", "5000"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [row] = _rows(proc.stdout)  # the benchmark exits non-zero unless all 5,000 objects came back
    assert row[0] == "5,000" and float(row[2]) > 0 and float(row[3]) > 0


def test_auth_cost_measures_every_part_against_real_ops(tmp_path):
    """benchmarks/auth_cost.py at 20 iterations: a real master, node and client; every figure is written and
    positive, the authenticated connect costs more than a bare one, and every op row is printed."""
    import json

    out = tmp_path / "auth.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "auth_cost.py"), "--iters", "20", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert all(r[k] > 0 for k in r if k not in ("cpu", "iters")) and r["connect_auth_us"] > r["connect_us"]
    assert [
        ln.split("|")[1].strip() for ln in proc.stdout.splitlines() if ln.startswith("| one") or ln.startswith("| 32")
    ] == ["one 4 KiB put", "one 4 KiB get", "32 x 1 MiB put", "32 x 1 MiB get"]


def test_master_ops_bench_compares_the_native_front_with_the_python_path():
    """benchmarks/master_ops_bench.py --vs-python at a few iterations: each op's row is printed for both columns
    (the benchmark itself checks that its gets find every key it put)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "master_ops_bench.py"), "--vs-python", "--rounds", "1"]
        + ["--iters", "5", "--batch", "16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[2:] if line.strip()}
    assert set(rows) >= {"put", "put_start", "put_commit", "get", "exists", "remove"}, proc.stdout
    assert all(len(v) == 3 and float(v[0]) > 0 and float(v[1]) > 0 for v in rows.values()), proc.stdout
