"""Smoke tests of the master's scale benchmarks (issue #18) at small counts, so they keep running: master_memory.py
against a real `kvplugins master` + store node (ours only: Mooncake needs root and a network namespace) and
master_recovery.py against a real etcd (a fill through the leader's journal, then load + restore in a fresh
process, which must recover every object). Speed is not asserted (benchmarks prove speed)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))


def _rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if re.match(r"^\| [\w-]*[\d,]+ ", line) or line.startswith("| kvp")]


def test_master_memory_reports_our_master():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "master_memory.py"), "--objects", "20000"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [row] = _rows(proc.stdout)
    assert row[0] == "kvp-tcp" and row[1] == "20,000" and int(row[2]) > 0 and int(row[4].replace(",", "")) > 0


def test_master_recovery_recovers_every_object():
    from helpers.etcd import etcd_binary
    try:
        etcd_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "master_recovery.py"), "--objects", "5000"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [row] = _rows(proc.stdout)          # the benchmark exits non-zero unless all 5,000 objects came back
    assert row[0] == "5,000" and float(row[2]) > 0 and float(row[3]) > 0
