"""Whether an engine package is installed, without importing it: ``find_spec("vllm")`` / ``importorskip("vllm")``
also succeed on the tests' own ``tests/vllm/`` and ``tests/sglang/`` folders (namespace packages on the tests'
path), so a machine without the engine ran those tests instead of skipping them (seen on the GPU machine)."""

from __future__ import annotations

import importlib.metadata

import pytest


def installed(top_level: str) -> bool:
    """True when an installed distribution provides the top-level package ``top_level`` (e.g. "vllm")."""
    return bool(importlib.metadata.packages_distributions().get(top_level))


def require(top_level: str, how: str) -> None:
    """Skip the calling test (or module) unless ``top_level`` is installed; ``how``: the install command."""
    if not installed(top_level):
        pytest.skip(f"{top_level} is not installed: {how}", allow_module_level=True)
