"""The connector's KV events on a real vLLM CPU engine (issue #15): with vLLM's kv_events_config on, vLLM publishes
(over its own ZmqEventPublisher, to a SUB socket this test binds) a BlockStored with medium CPU for every page the
connector saved, carrying vLLM's block hash, the parent hash, the page's tokens and its KV cache group (index and
kind, as vLLM's own events of that group); each such page is in the store under the key the hash names. A hybrid
model (LFM2: a full-attention and a Mamba-state group) reports each group's pages."""

from __future__ import annotations

import contextlib
import json
import threading

import msgspec
import pytest
from helpers.installed import require
import zmq
from helpers.cluster import store_cluster
from kvp_vllm_helpers import BLOCK, page_hashes

from kvplugins.demo.engine import EngineSpec, run_fresh
from kvplugins.layout import KeySpace

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@contextlib.contextmanager
def subscriber():
    """A SUB socket on a free port collecting vLLM's KV event batches: yields (endpoint, events list, stop)."""
    from vllm.distributed.kv_events import KVEventBatch

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")  # vLLM's PUB connects to a non-wildcard endpoint
    got, stop = [], threading.Event()
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode

    def collect():
        while not stop.is_set():
            if sub.poll(100):
                got.extend(decode(sub.recv_multipart()[-1]).events)

    t = threading.Thread(target=collect)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{port}", got, lambda: (stop.wait(2), stop.set(), t.join())  # last step's events
    finally:
        stop.set()
        t.join()
        sub.close(0)
        ctx.term()


def run_with_events(model, prompts, tmp_path, dtype="float32"):
    """One engine with the connector and KV events on: (result, its BlockStored events with medium CPU, vLLM's
    own BlockStored events, namespace file, each group's stored pages among the prompts' and outputs' pages)."""
    from vllm.distributed.kv_events import BlockStored
    from kvplugins.store import ClientConfig, StoreClient

    with subscriber() as (endpoint, got, finish), store_cluster(nodes=1, segment_size="256MiB") as c:
        ns = tmp_path / "ns.json"
        a = run_fresh(
            EngineSpec(
                model,
                prompts,
                dtype=dtype,
                kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint},
                connector={"store": {"master": c.master}, "namespace_file": str(ns)},
            )
        )
        finish()
        info = json.loads(ns.read_text())
        with StoreClient(ClientConfig(master=c.master)) as client:
            stored = {}
            for req in info["required"]:  # each group's first key space (its first KV head)
                ks = KeySpace(**req[0])
                pages = [h for ids, out in zip(a["prompt_token_ids"], a["tokens"]) for h in page_hashes(ids + out)]
                stored[ks.layer_group] = {h for h, ok in zip(pages, client.batch_exists(ks.keys(pages))) if ok}
    blocks = [e for e in got if isinstance(e, BlockStored)]
    return a, [e for e in blocks if e.medium == "CPU"], [e for e in blocks if e.medium != "CPU"], info, stored


def test_saved_pages_are_published_as_vllm_kv_events(model, turn_prompts, tmp_path):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as external

    a, ours, engine, info, stored = run_with_events(model, turn_prompts[0], tmp_path)
    (pages,) = stored.values()
    assert len(pages) >= sum(n // BLOCK for n in a["prompt_tokens"]) > 0  # every full prompt page was saved...
    assert {e.block_hashes[0] for e in ours} >= {external(h) for h in pages}  # ...and announced by its hash
    first = [e for e in ours if e.parent_block_hash is None]
    prompts = a["prompt_token_ids"]
    assert {tuple(e.token_ids) for e in first} == {tuple(p[:BLOCK]) for p in prompts}  # a prompt's first page
    assert all(e.block_size == BLOCK and len(e.token_ids) == BLOCK for e in ours)
    kinds = {(e.group_idx, e.kv_cache_spec_kind) for e in engine}
    assert {(e.group_idx, e.kv_cache_spec_kind) for e in ours} == kinds == {(0, "full_attention")}


def test_hybrid_model_publishes_each_groups_pages(turn_prompts, tmp_path):
    """LFM2: the attention group announces every saved page; the state group the pages whose state it saved (a
    prompt's last full page at least); both under their group index and kind, as vLLM's own events."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as external

    from kvplugins.demo.model import ensure_model

    a, ours, engine, info, stored = run_with_events(str(ensure_model(family="lfm2")), turn_prompts[0], tmp_path)
    by_group = {}
    for e in ours:
        by_group.setdefault((e.group_idx, e.kv_cache_spec_kind), set()).add(e.block_hashes[0])
    assert set(by_group) == {(e.group_idx, e.kv_cache_spec_kind) for e in engine} and len(by_group) == 2
    state = next(g["layer_group"] for g in info["groups"] if "layout=state:" in g["extra"])
    for (idx, kind), hashes in by_group.items():
        pages = stored[state] if kind == "mamba" else stored[next(k for k in stored if k != state)]
        assert hashes == {external(h) for h in pages} and pages  # announced exactly what the store holds
    assert len(stored[state]) >= len(a["prompt_tokens"])  # one state at least per prompt
