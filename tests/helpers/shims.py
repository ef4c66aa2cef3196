"""Run a Python snippet in a fresh interpreter that sees an opt-in shim (kvplugins/shims.py) enabled into a
throw-away site dir (``tmp_path``), as a user's process would after ``kvplugins <name> enable``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def shim_probe(shim, tmp_path: Path, code: str) -> list[str]:
    """Enable ``shim`` (a Shim) under ``tmp_path``, run ``code`` there; its stdout split on whitespace."""
    shim.enable(tmp_path, force=True)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path / shim.shim_dir)},
    ).stdout.split()
