"""Real vLLM engines (fresh processes, CPU) sharing KV through a real store on loopback.

Engine A computes first turns and saves their pages; a fresh engine B gets the next turns and must (1) load
the shared prefix from the store and (2) produce the same greedy tokens as an engine without the connector.
Controls: corrupting the stored pages changes B's tokens (so the loaded KV is really used), a page that fails
to load is reported and recomputed (identical tokens), and with the store down the engine still serves,
with identical tokens.
"""
from __future__ import annotations

import json
import os
import socket

import pytest
from kvp_vllm_helpers import BLOCK, page_keys

from kvplugins.demo.engine import EngineSpec, run_fresh

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def baseline(model, turn_prompts):
    return run_fresh(EngineSpec(model, turn_prompts[1]))


@pytest.fixture(scope="module")
def shared(model, turn_prompts, cluster, tmp_path_factory):
    """Engine A then a fresh engine B, both with the connector; returns (A, B, namespace file content)."""
    ns = tmp_path_factory.mktemp("ns") / "namespace.json"
    conn = {"master": cluster.master, "namespace_file": str(ns)}
    a = run_fresh(EngineSpec(model, turn_prompts[0], connector=conn))
    b = run_fresh(EngineSpec(model, turn_prompts[1], connector=conn))
    return a, b, json.loads(ns.read_text())


def test_fresh_instance_gets_external_hits_and_identical_tokens(shared, baseline):
    a, b, _ = shared
    assert a["external_hit_tokens"] == 0
    shared_pages = sum(n // BLOCK for n in a["prompt_tokens"])  # A's full pages are B's prefix
    assert b["external_hit_tokens"] == shared_pages * BLOCK > 1000
    assert b["tokens"] == baseline["tokens"]
    assert all(len(t) == 16 for t in b["tokens"])


def stored_page_keys(client, b, info) -> list[str]:
    keys = [k for ids in b["prompt_token_ids"] for k in page_keys(info["keyspace"], ids)]
    stored = [k for k, ok in zip(keys, client.batch_exists(keys)) if ok]
    assert len(stored) >= b["external_hit_tokens"] // BLOCK  # the keys we compute are the engine's
    return stored


def replace_pages(client, keys, nbytes: int) -> None:
    """Overwrite stored pages with random bytes (a put of an existing key is a no-op, so remove first)."""
    client.batch_remove(keys)
    assert not any(client.batch_put(keys, [os.urandom(nbytes) for _ in keys]))


def test_page_that_fails_to_load_is_recomputed(shared, baseline, model, turn_prompts, cluster, tmp_path):
    from kvplugins.store import ClientConfig, StoreClient
    _, b, info = shared
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        stored = stored_page_keys(client, b, info)
        replace_pages(client, stored[5:6], info["keyspace"]["page_bytes"] // 2)  # wrong size: load fails
    log = tmp_path / "engine.log"
    r = run_fresh(EngineSpec(model, turn_prompts[1], connector={"master": cluster.master},
                             load_failure="recompute"), log_path=str(log))
    assert "1 of" in log.read_text() and "pages failed to load" in log.read_text()
    assert r["tokens"] == baseline["tokens"]


def test_corrupted_pages_change_tokens(shared, baseline, model, turn_prompts, cluster):
    from kvplugins.store import ClientConfig, StoreClient
    _, b, info = shared
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        replace_pages(client, stored_page_keys(client, b, info), info["keyspace"]["page_bytes"])
    bad = run_fresh(EngineSpec(model, turn_prompts[1], connector={"master": cluster.master}))
    assert bad["external_hit_tokens"] >= b["external_hit_tokens"]  # B saved its own pages too
    assert bad["tokens"] != baseline["tokens"]


def test_store_down_still_serves_identical_tokens(model, turn_prompts, baseline, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    log = tmp_path / "engine.log"
    r = run_fresh(EngineSpec(model, turn_prompts[1], connector={"master": dead, "rpc_timeout_ms": 300}),
                  log_path=str(log))
    assert r["external_hit_tokens"] == 0
    assert r["tokens"] == baseline["tokens"]
    assert "store unavailable, serving without it" in log.read_text()
