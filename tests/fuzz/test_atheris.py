"""CI run of the coverage-guided decoder fuzz (fuzz_decoders.py, atheris/libFuzzer), bounded in time (#11).

Each target runs in its own process for KVPLUGINS_FUZZ_SECONDS (default 6 s; 6 targets, about 45 s in all;
set it higher for a longer hunt, e.g. KVPLUGINS_FUZZ_SECONDS=600). The run must end by its time limit with exit
code 0 (no finding, no input over -timeout, no RSS over -rss_limit_mb) after at least MIN_RUNS inputs; a
finding's input is saved next to the test's tmp dir and named in the failure (replay it with
``python tests/fuzz/fuzz_decoders.py TARGET FILE``). Skipped, visibly, where atheris is not installed.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("fuzz_decoders.py")
SECONDS = int(os.environ.get("KVPLUGINS_FUZZ_SECONDS", "6"))
MIN_RUNS = 2000  # the slowest target (disk: a file write per input) does ~5000/s on one core
INPUT_TIMEOUT_S = 10  # one input taking longer is a hang (a finding)
RSS_LIMIT_MB = 1024  # a decoder allocating past this on a <= 64 KiB input is a finding


def _targets() -> tuple[str, ...]:
    """The harness's TARGETS, read from its source (importing it needs atheris)."""
    for node in ast.parse(HARNESS.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TARGETS":
            return ast.literal_eval(node.value)
    raise AssertionError(f"no TARGETS in {HARNESS}")


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("atheris") is None,
        reason="atheris is not installed (pip install atheris; x86_64 wheels): decoder fuzz not run",
    ),
]


def _runs(output: str) -> int:
    """Inputs executed, from libFuzzer's "Done N runs" line (else its last "#N" status line)."""
    done = re.findall(r"^Done (\d+) runs", output, re.M)
    if done:
        return int(done[-1])
    status = re.findall(r"^#(\d+)\s", output, re.M)
    return int(status[-1]) if status else 0


@pytest.mark.timeout(SECONDS + 120)
@pytest.mark.parametrize("target", _targets())
def test_decoder_fuzz(target, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # through a shell that forks the harness: libFuzzer's -rss_limit_mb reads the peak RSS (getrusage), which
    # survives execve, so a harness exec'd straight from a pytest process grown past 1 GiB (after the store
    # suites, in another order) would start "out of memory"; a forked child starts its own count
    cmd = [
        "/bin/sh",
        "-c",
        '"$@"; exit $?',
        "sh",
        sys.executable,
        str(HARNESS),
        target,
        str(corpus),
        f"-max_total_time={SECONDS}",
        f"-timeout={INPUT_TIMEOUT_S}",
        f"-rss_limit_mb={RSS_LIMIT_MB}",
        "-max_len=65536",
        f"-artifact_prefix={tmp_path}/",
        "-print_final_stats=1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SECONDS + 90, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    findings = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-")))
    assert proc.returncode == 0, (
        f"fuzz target {target!r} found a bug (exit {proc.returncode}); inputs {findings} "
        f"in {tmp_path}:\n{output[-6000:]}"
    )
    runs = _runs(output)
    print(f"fuzz {target}: {runs} runs in {SECONDS} s")
    assert runs >= MIN_RUNS, f"fuzz target {target!r} ran only {runs} inputs:\n{output[-3000:]}"
