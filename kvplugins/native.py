"""Small Pythonic wrapper over the raw nanobind module ``kvplugins._native``.

Native failures become kvplugins exceptions here and nowhere else. Blocking native calls release the GIL.
"""
from __future__ import annotations

import numpy as np

from kvplugins.errors import NativeError


def _mod():
    try:
        from kvplugins import _native
    except ImportError as e:  # pragma: no cover - a broken install
        raise NativeError(f"kvplugins native module is not built ({e}); reinstall with `pip install .`") from e
    return _native


def copy(dst_addr: int, src_addr: int, nbytes: int) -> None:
    """memcpy ``nbytes`` from address ``src_addr`` to ``dst_addr`` with the GIL released."""
    if nbytes:
        _mod().copy(dst_addr, src_addr, nbytes)


def copy_batch(dst_addrs, src_addrs, lengths, threads: int = 1) -> None:
    """Copy span i: ``lengths[i]`` bytes from ``src_addrs[i]`` to ``dst_addrs[i]`` (uint64 sequences).

    Spans must not overlap. With threads > 1 and >= 4 MiB in all, the copy is split across threads.
    Raises NativeError if the three sequences differ in length.
    """
    d = np.ascontiguousarray(dst_addrs, dtype=np.uint64)
    s = np.ascontiguousarray(src_addrs, dtype=np.uint64)
    n = np.ascontiguousarray(lengths, dtype=np.uint64)
    try:
        _mod().copy_batch(d, s, n, int(threads))
    except ValueError as e:
        raise NativeError(str(e)) from e
