"""The connector's KV events on a real vLLM CPU engine (issue #15): with vLLM's kv_events_config on, vLLM publishes
(over its own ZmqEventPublisher, to a SUB socket this test binds) a BlockStored with medium CPU for every page the
connector saved, carrying vLLM's block hash, the parent hash and the page's tokens; each such page is in the store
under the key the hash names."""
from __future__ import annotations

import json
import threading

import msgspec
import pytest
import zmq
from helpers.cluster import store_cluster
from kvp_vllm_helpers import BLOCK, page_hashes

from kvplugins.demo.engine import EngineSpec, run_fresh
from kvplugins.layout import KeySpace

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_saved_pages_are_published_as_vllm_kv_events(model, turn_prompts, tmp_path):
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")       # vLLM's PUB connects to a non-wildcard endpoint
    got, stop = [], threading.Event()
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode

    def collect():
        while not stop.is_set():
            if sub.poll(100):
                got.extend(decode(sub.recv_multipart()[-1]).events)
    t = threading.Thread(target=collect)
    t.start()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    try:
        with store_cluster(nodes=1, segment_size="256MiB") as c:
            ns = tmp_path / "ns.json"
            a = run_fresh(EngineSpec(model, turn_prompts[0], connector={"master": c.master, "namespace_file": str(ns)},
                                     kv_events=events))
            stop.wait(2)                                     # the last step's events are on their way
            stop.set()
            t.join()
            ours = [e for e in got if isinstance(e, BlockStored) and e.medium == "CPU"]
            ks = KeySpace(**json.loads(ns.read_text())["keyspace"])
            pages = [h for ids in a["prompt_token_ids"] for h in page_hashes(ids)]
            from kvplugins.store import ClientConfig, StoreClient
            with StoreClient(ClientConfig(master=c.master)) as client:
                stored = [h for h, ok in zip(pages, client.batch_exists(ks.keys(pages))) if ok]
        assert len(stored) == len(pages) > 0                 # every full prompt page was saved...
        external = maybe_convert_block_hash                  # ...and announced under vLLM's external hash
        assert {e.block_hashes[0] for e in ours} >= {external(h) for h in stored}
        first = [e for e in ours if e.parent_block_hash is None]
        prompts = a["prompt_token_ids"]
        assert {tuple(e.token_ids) for e in first} == {tuple(p[:BLOCK]) for p in prompts}   # a prompt's first page
        assert all(e.block_size == BLOCK and len(e.token_ids) == BLOCK for e in ours)
    finally:
        stop.set()
        t.join()
        sub.close(0)
        ctx.term()
