"""Process plumbing shared by the store's servers: atomic port/ready/discovery files, clean stop on signals."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file + rename, so readers never see a partial file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, p)


def stop_on_signals(callback) -> None:
    """Call ``callback()`` on SIGTERM/SIGINT (main thread only), so servers exit through their cleanup."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: callback())
