"""Two-process drives of engines' Mooncake Transfer Engine classes on ours (issue #36's class-level tests): one
worker script per test, run as a long-lived side (prints one JSON line when ready, answers lines on stdin, exits 0
when stdin closes) and a one-shot side (its last stdout line is JSON)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator


def shimmed_env(site_dir: Path, memory: str) -> dict:
    """The workers' environment, after ``kvplugins mooncake enable`` into ``site_dir`` (the workers add it as a
    site dir, so their ``mooncake.engine`` is ours): ``memory`` "device" registers their tensors as emulated
    device memory."""
    from kvplugins.mooncake import shim as mooncake_shim

    mooncake_shim.SHIM.enable(site_dir, force=True)
    return {**os.environ, "KVPLUGINS_TRANSFER_DEVICE_EMULATION": "1" if memory == "device" else "0"}


@contextlib.contextmanager
def served(script: Path, *args: str, env: dict) -> Iterator[tuple[Any, subprocess.Popen]]:
    """Start ``script args`` and yield (its first JSON line, the process); on exit close its stdin and check that
    it exited 0."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
            text=True, env=env,
        )  # fmt: skip
        try:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                proc.wait(timeout=30)
                err.seek(0)
                raise AssertionError(f"{script.name} {args[0]} ended before it was ready:\n{err.read()[-3000:]}")
            yield json.loads(line), proc
        finally:
            proc.stdin.close()  # type: ignore[union-attr]
            rc = proc.wait(timeout=30)
        err.seek(0)
        assert rc == 0, err.read()[-3000:]


def ask(proc: subprocess.Popen, line: str) -> Any:
    """Send ``line`` to a served worker and return its JSON answer."""
    proc.stdin.write(line + "\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    return json.loads(proc.stdout.readline())  # type: ignore[union-attr]


def run(script: Path, *args: str, env: dict) -> tuple[Any, str]:
    """Run ``script args`` to its end: (its last stdout line as JSON, its stderr). Asserts it exited 0."""
    got = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=180, env=env
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1]), got.stderr
