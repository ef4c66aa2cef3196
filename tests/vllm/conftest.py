"""Shared fixtures for the real-engine tests: the demo model, a private store cluster, the demo prompts
(page keys: kvp_vllm_helpers.py)."""
from __future__ import annotations

import pytest
from helpers.cluster import store_cluster

from kvplugins.demo.engine import EngineSpec, run_fresh
from kvplugins.demo.run import DemoConfig, prompts


@pytest.fixture(scope="session")
def model() -> str:
    from kvplugins.demo.model import ensure_model
    return str(ensure_model())


@pytest.fixture(scope="session")
def turn_prompts() -> tuple[list[str], list[str]]:
    """(first-turn prompts for engine A, next-turn prompts for engine B), ~1,200 and ~1,700 tokens."""
    return prompts(DemoConfig(conversations=2))


@pytest.fixture(scope="module")
def cluster():
    with store_cluster(nodes=1, segment_size="256MiB") as c:
        yield c


@pytest.fixture(scope="session")
def baseline(model, turn_prompts):
    """The next-turn prompts on an engine without the connector: the tokens every connector run must match."""
    return run_fresh(EngineSpec(model, turn_prompts[1]))
