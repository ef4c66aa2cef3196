"""A hybrid model through real vLLM engines (CPU, fresh processes) and a real store on loopback: a tiny
random-weight Gemma-3 (Gemma3ForCausalLM, sliding-window layers beside full-attention ones; vLLM's hybrid
memory allocator makes one KV cache group of each). Engine A computes the first turns; a fresh engine B must
load the next turns' shared prefix (every full-attention page, and of the sliding-window group only the pages
inside the window before the hit's end, as vLLM's own prefix cache) and produce the greedy tokens of an
engine without the connector. Control: the sliding-window pages B loaded, overwritten with random bytes,
change the tokens of a fresh engine C (those pages are really read); one byte flipped in every stored page
(every load fails its checksum) leaves them equal (the failed load fails the whole request; issue #30 item 9)."""

from __future__ import annotations

import json

import pytest
from helpers.installed import require
from kvp_vllm_helpers import BLOCK, engine_pair, flipped, object_bytes, page_keys, replace_pages, stored_group_keys

from kvplugins.demo.engine import EngineSpec, run_fresh

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def gemma() -> str:
    from kvplugins.demo.model import ensure_model

    return str(ensure_model(family="gemma3"))


@pytest.fixture(scope="module")
def gemma_baseline(gemma, turn_prompts):
    return run_fresh(EngineSpec(gemma, turn_prompts[1]))


@pytest.fixture(scope="module")
def shared(gemma, turn_prompts, cluster, tmp_path_factory):
    """Engine A then a fresh engine B (the connector in both); returns (A, B, namespace file content)."""
    return engine_pair(gemma, turn_prompts, cluster.master, tmp_path_factory.mktemp("ns") / "namespace.json")


def _window_pages() -> int:
    from kvplugins.demo.model import GEMMA3_WINDOW

    return -(-(GEMMA3_WINDOW - 1) // BLOCK)  # vLLM: cdiv(sliding_window - 1, block_size)


def test_hybrid_fresh_instance_gets_external_hits_and_identical_tokens(shared, gemma_baseline):
    a, b, info = shared
    groups = info["groups"]
    assert len(groups) == 2 and len({g["layer_group"] for g in groups}) == 2  # one group per attention kind
    assert len({json.dumps(g, sort_keys=True) for g in groups}) == 2
    shared_pages = [n // BLOCK for n in a["prompt_tokens"]]  # A's full pages are B's prefix
    assert b["external_hit_tokens"] == sum(shared_pages) * BLOCK > 1000
    assert b["tokens"] == gemma_baseline["tokens"] and all(len(t) == 16 for t in b["tokens"])
    stats = b["kvplugins"]
    window = sum(min(_window_pages(), n) for n in shared_pages)
    assert stats["loaded_blocks"] == stats["async_blocks"] == sum(shared_pages) + window  # full + window only
    assert stats["failed_blocks"] == 0 and stats["hit_blocks"] == sum(shared_pages)
    assert a["kvplugins"]["saved_blocks"] >= sum(shared_pages) + window  # both groups saved


def test_hybrid_corrupted_window_pages_change_tokens(shared, gemma_baseline, gemma, turn_prompts, cluster):
    from kvplugins.store import ClientConfig, StoreClient

    a, b, info = shared
    sliding = next(i for i, g in enumerate(info["groups"]) if ".layers.0." in g["layer_group"])  # alternating
    keys = []  # C's hit ends where B's saved prompt pages end (the last page is recomputed): its window before
    for ks in info["required"][sliding]:  # each KV head's objects
        for ids in b["prompt_token_ids"]:
            end = (len(ids) - 1) // BLOCK
            keys += page_keys(ks, ids)[end - _window_pages() : end]
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        assert all(client.batch_exists(keys))  # the window pages B loaded are in the store
        replace_pages(client, keys, object_bytes(info, sliding))
    bad = run_fresh(EngineSpec(gemma, turn_prompts[1], connector={"store": {"master": cluster.master}}))
    assert bad["external_hit_tokens"] == sum((len(ids) - 1) // BLOCK for ids in b["prompt_token_ids"]) * BLOCK
    assert bad["kvplugins"]["failed_blocks"] == 0  # the random bytes carry their own checksum: they load
    assert bad["tokens"] != gemma_baseline["tokens"]


def test_hybrid_failed_loads_recompute_identical_tokens(shared, gemma_baseline, gemma, turn_prompts, cluster):
    from kvplugins.store import ClientConfig, StoreClient

    _, b, info = shared
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        keys = stored_group_keys(client, b, info)
        assert len(keys) >= b["external_hit_tokens"] // BLOCK
        with flipped(client, keys):
            bad = run_fresh(EngineSpec(gemma, turn_prompts[1], connector={"store": {"master": cluster.master}}))
    assert bad["kvplugins"]["failed_blocks"] > 0 and bad["kvplugins"].get("loaded_blocks", 0) == 0
    assert bad["tokens"] == gemma_baseline["tokens"]
