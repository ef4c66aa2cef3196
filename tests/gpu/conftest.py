"""tests/gpu/: the GPU paths with CUDA tensors. They run only where ``torch.cuda.is_available()``; everywhere else
every test here is skipped with the reason shown in the summary (``pytest -ra``). The same logic runs on CPU
in CI with staging forced (tests/layout/test_staged.py, tests/vllm/test_staged_e2e.py)."""

from __future__ import annotations

import pytest
from helpers.cluster import store_cluster

torch = pytest.importorskip("torch")
NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False): tests/gpu/ runs only on a GPU machine"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(scope="module")
def master():
    """A store (master + one 256 MiB node) on loopback, per test module."""
    with store_cluster(nodes=1, segment_size="256MiB") as c:
        yield c.master
