"""Layer-wise loads (issue #14, ``layer_chunks``) on real vLLM CPU engines: engine A stores every page as 3
objects of consecutive layers; a fresh engine B loads them before its forward (``async_load_tokens=0``), chunk by
chunk on the load thread while its attention layers wait only for their own chunk (vLLM's
``wait_for_layer_load``). B must get every shared page as an external hit, the greedy tokens of an engine without
the connector, and its layers must really have waited per chunk; corrupting only the last chunk's objects
changes B's tokens (the last layers read their bytes from the store, not from a recompute)."""

from __future__ import annotations

import json

import pytest
from helpers.installed import require
from helpers.cluster import store_cluster
from kvp_vllm_helpers import BLOCK, object_bytes, object_keys, replace_pages

from kvplugins.demo.engine import EngineSpec, run_fresh

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
CHUNKS = 3


@pytest.fixture(scope="module")
def cluster():
    with store_cluster(nodes=1, segment_size="256MiB") as c:
        yield c


def layered(cluster, **more) -> dict:
    return {"store": {"master": cluster.master}, "layer_chunks": CHUNKS, "async_load_tokens": 0, **more}


@pytest.fixture(scope="module")
def runs(model, turn_prompts, cluster, tmp_path_factory):
    """A then a fresh B, both layer-wise; returns (A, B, B's namespace file)."""
    ns = tmp_path_factory.mktemp("layerwise") / "ns.json"
    a = run_fresh(EngineSpec(model, turn_prompts[0], connector=layered(cluster)))
    b = run_fresh(EngineSpec(model, turn_prompts[1], connector=layered(cluster, namespace_file=str(ns))))
    return a, b, json.loads(ns.read_text())


def test_layerwise_loads_give_external_hits_and_identical_tokens(runs, baseline):
    a, b, info = runs
    assert len(info["groups"]) == CHUNKS  # three key spaces: one per chunk of layers
    shared_pages = sum(n // BLOCK for n in a["prompt_tokens"])
    assert a["kvplugins"]["saved_blocks"] >= shared_pages * CHUNKS
    assert b["external_hit_tokens"] == shared_pages * BLOCK > 1000
    assert b["kvplugins"]["loaded_blocks"] == shared_pages * CHUNKS and b["kvplugins"]["failed_blocks"] == 0
    assert b["kvplugins"]["async_blocks"] == 0  # loaded before the forward, not in the background
    assert b["kvplugins"]["layer_waits"] >= len(a["prompt_tokens"]) * CHUNKS  # every chunk waited for per load
    assert b["tokens"] == baseline["tokens"]


def test_corrupted_last_chunk_changes_tokens(runs, baseline, model, turn_prompts, cluster):
    from kvplugins.store import ClientConfig, StoreClient

    _, b, info = runs
    last = len(info["required"]) - 1
    keys = [k for ids in b["prompt_token_ids"] for k in object_keys(info, last, ids)]
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        keys = [k for k, ok in zip(keys, client.batch_exists(keys)) if ok]
        assert len(keys) >= b["external_hit_tokens"] // BLOCK
        replace_pages(client, keys, object_bytes(info, last))
    bad = run_fresh(EngineSpec(model, turn_prompts[1], connector=layered(cluster)))
    assert bad["external_hit_tokens"] >= b["external_hit_tokens"] and bad["kvplugins"]["failed_blocks"] == 0
    assert bad["tokens"] != baseline["tokens"]
