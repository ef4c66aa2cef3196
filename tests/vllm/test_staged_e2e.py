"""The staged page path (issue #14: how a GPU KV cache reaches the store) on real vLLM CPU engines, with staging
forced (``staging='always'``): every page goes KV blocks -> host bounce slot -> store and back through the same
gather/scatter code a CUDA KV cache takes. Engine A saves its pages staged; a fresh engine B loads them staged
and must produce the greedy tokens of an engine without the connector, with every shared page an external hit;
pages saved straight from the blocks (another engine, staging off) load staged too; and corrupting the stored
pages changes B's tokens (the staged bytes are really what the forward reads). tests/gpu/ runs the staged
path with CUDA tensors where a GPU exists."""

from __future__ import annotations

import json

import pytest
from helpers.installed import require
from helpers.cluster import store_cluster
from kvp_vllm_helpers import BLOCK, object_bytes, replace_pages, stored_page_keys

from kvplugins.demo.engine import EngineSpec, run_fresh

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
BOUNCE = 8 << 20  # 4 slots of 2 MiB: a 1,700-token prompt's pages move in several chunks


@pytest.fixture(scope="module")
def cluster():
    with store_cluster(nodes=1, segment_size="256MiB") as c:
        yield c


def staged(cluster, **more) -> dict:
    return {"store": {"master": cluster.master}, "staging": "always", "bounce_bytes": BOUNCE, **more}


@pytest.fixture(scope="module")
def runs(model, turn_prompts, cluster, tmp_path_factory):
    """A then a fresh B, both staged; returns (A, B, namespace file content, B's log text)."""
    d = tmp_path_factory.mktemp("staged")
    a = run_fresh(EngineSpec(model, turn_prompts[0], connector=staged(cluster, namespace_file=str(d / "ns.json"))))
    b = run_fresh(EngineSpec(model, turn_prompts[1], connector=staged(cluster)), log_path=str(d / "b.log"))
    return a, b, json.loads((d / "ns.json").read_text()), (d / "b.log").read_text()


def test_staged_pages_give_external_hits_and_identical_tokens(runs, baseline):
    a, b, _, log = runs
    assert "B pages on cpu, staged, namespace" in log  # the worker took the bounce path
    shared_pages = sum(n // BLOCK for n in a["prompt_tokens"])
    assert a["kvplugins"]["saved_blocks"] >= shared_pages
    assert b["external_hit_tokens"] == shared_pages * BLOCK > 1000
    assert b["kvplugins"]["loaded_blocks"] == shared_pages and b["kvplugins"]["failed_blocks"] == 0
    assert b["tokens"] == baseline["tokens"]


def test_pages_saved_without_staging_load_staged(model, turn_prompts, baseline, tmp_path):
    """Staged and direct pages are the same bytes under the same keys: a direct save, a staged load."""
    with store_cluster(nodes=1, segment_size="256MiB") as c:
        run_fresh(EngineSpec(model, turn_prompts[0], connector={"store": {"master": c.master}, "staging": "never"}))
        b = run_fresh(EngineSpec(model, turn_prompts[1], connector=staged(c)))
        store_log = c.master_proc.log_tail() + c.nodes[0].log_tail()  # (why, if B found no page)
    assert b["external_hit_tokens"] > 1000 and b["kvplugins"]["failed_blocks"] == 0, (b["kvplugins"], store_log)
    assert b["tokens"] == baseline["tokens"]


def test_corrupted_pages_change_staged_tokens(runs, baseline, model, turn_prompts, cluster):
    from kvplugins.store import ClientConfig, StoreClient

    _, b, info, _ = runs
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        st = client.master_call("status", [])
        assert st["objects_lost"] == 0, (st, cluster.master_proc.log_tail())  # no page lost since A saved
        replace_pages(client, stored_page_keys(client, b, info), object_bytes(info))
    bad = run_fresh(EngineSpec(model, turn_prompts[1], connector=staged(cluster)))
    assert bad["external_hit_tokens"] >= b["external_hit_tokens"]
    assert bad["tokens"] != baseline["tokens"]
