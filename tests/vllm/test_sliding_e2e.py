"""A model whose every layer is sliding-window (one KV cache group, sliding: Mistral-7B v0.1's shape) through
real vLLM engines (CPU, fresh processes) and a real store on loopback: a tiny random-weight MistralForCausalLM,
window 200 tokens. Engine A computes the first turns; a fresh engine B must hit the next turns' shared prefix,
load only the window's pages before the hit's end, and produce the greedy tokens of an engine without the
connector. Then one byte flipped in every stored page (each load fails its checksum): a fresh engine must still
produce those tokens (issue #30 item 9: the failed load fails the whole request, which vLLM recomputes; handing
back failed block ids made vLLM recompute from the first failed window page while the pages before it were
never loaded: wrong tokens)."""

from __future__ import annotations

import pytest
from helpers.installed import require
from kvp_vllm_helpers import BLOCK, engine_pair, flipped, stored_page_keys

from kvplugins.demo.engine import EngineSpec, run_fresh

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def mistral() -> str:
    from kvplugins.demo.model import ensure_model

    return str(ensure_model(family="mistral"))


@pytest.fixture(scope="module")
def mistral_baseline(mistral, turn_prompts):
    return run_fresh(EngineSpec(mistral, turn_prompts[1]))


@pytest.fixture(scope="module")
def shared(mistral, turn_prompts, cluster, tmp_path_factory):
    """Engine A then a fresh engine B (the connector in both); returns (A, B, namespace file content)."""
    return engine_pair(mistral, turn_prompts, cluster.master, tmp_path_factory.mktemp("ns") / "namespace.json")


def _window_pages() -> int:
    from kvplugins.demo.model import MISTRAL_WINDOW

    return -(-(MISTRAL_WINDOW - 1) // BLOCK)  # vLLM: cdiv(sliding_window - 1, block_size)


def test_all_sliding_fresh_instance_loads_only_the_window_and_gets_identical_tokens(shared, mistral_baseline):
    a, b, info = shared
    assert len(info["groups"]) == 1  # one KV cache group; the window shows in what B loads
    shared_pages = [n // BLOCK for n in a["prompt_tokens"]]  # A's full pages are B's prefix
    assert b["external_hit_tokens"] == sum(shared_pages) * BLOCK > 1000
    assert b["tokens"] == mistral_baseline["tokens"] and all(len(t) == 16 for t in b["tokens"])
    stats = b["kvplugins"]
    assert stats["loaded_blocks"] == stats["async_blocks"] == sum(min(_window_pages(), n) for n in shared_pages)
    assert stats["failed_blocks"] == 0 and stats["hit_blocks"] == sum(shared_pages)


def test_all_sliding_failed_window_loads_recompute_identical_tokens(
    shared, mistral_baseline, mistral, turn_prompts, cluster, tmp_path
):
    from kvplugins.store import ClientConfig, StoreClient

    _, b, info = shared
    log = tmp_path / "engine.log"
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        keys = stored_page_keys(client, b, info)
        with flipped(client, keys):
            bad = run_fresh(
                EngineSpec(mistral, turn_prompts[1], connector={"store": {"master": cluster.master}}), log_path=str(log)
            )
    stats = bad["kvplugins"]
    assert stats["failed_blocks"] > 0 and stats.get("loaded_blocks", 0) == 0  # every window page failed
    assert "bytes read do not match the object's checksum" in log.read_text()
    assert bad["tokens"] == mistral_baseline["tokens"]
