"""The router's KV event feeds (kvplugins/router/feeds.py, blocks.py) against vLLM 0.32's own publisher and a real
store master: vLLM's ``ZmqEventPublisher`` (its class, its wire) tells the router what each instance caches, also
for prompts that never passed the router, and what it evicted; our connector's saves (medium CPU) and the master's
stream (object keys, removals included) what the shared pool holds, which the cost model then counts for every
instance; a publisher that starts again empties that instance's cache; a message of another shape is counted and
dropped. No engine runs here (tests/vllm/test_router_e2e.py runs real ones): the publisher is the engine's class,
sending events of the shape the engine sends. SGLang's publisher: tests/sglang/test_router_feeds_sglang.py."""

from __future__ import annotations

import pytest
from helpers.cluster import store_cluster
from helpers.installed import require
from helpers.router_feeds import BT, TOKENS, Engine, feeds, hashes, joined, predict, scenario, until

from kvplugins.store import ClientConfig, StoreClient

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
__all__ = ["feeds"]  # the fixture


def vllm_events():
    from vllm.distributed import kv_events

    return kv_events


def test_vllms_own_events_say_what_its_cache_and_the_pool_hold(feeds):
    scenario(vllm_events(), feeds, "CPU")  # our connector announces the pages it saved with medium CPU


def test_an_engine_that_starts_again_begins_with_an_empty_cache(feeds):
    """vLLM's publisher numbers its batches from 0: a stream whose number goes back is a new engine process."""
    a, b = Engine(vllm_events()), Engine(vllm_events())
    fleet, _ = feeds(kv_events=f"{a.endpoint},{b.endpoint}")
    try:
        joined(fleet, b, 1)
        h = hashes("vllm", 3)
        for _ in range(100):  # the old process published many batches
            b.send()
        b.send(b.stored(h, None, TOKENS[: 3 * BT]))
        until(lambda: fleet.status()[1]["cached_blocks"] == 3, "three blocks")
        b.close()
        b = Engine(vllm_events(), b.port)  # the engine restarted on the same port, its cache empty
        one = hashes("vllm", 1)
        until(lambda: (b.send(b.stored(one, None, TOKENS[:BT])), fleet.status()[1]["cached_blocks"] == 1)[1],
              "the new process's first block alone")  # fmt: skip
    finally:
        a.close()
        b.close()


def test_garbage_on_a_stream_is_dropped_and_counted(feeds):
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    good = Engine(vllm_events())
    try:
        fleet, f = feeds(kv_events=f"tcp://127.0.0.1:{port},{good.endpoint}")
        until(lambda: (pub.send_multipart([b"", b"\0" * 8, b"\xc1 not msgpack"]), f.status()["bad_messages"] > 0)[1],
              "the bad message counted")  # fmt: skip
        pub.send_multipart([b"only one frame"])
        joined(fleet, good, 1)  # the other stream is read all along
        h = hashes("vllm", 2)
        good.send(good.stored(h, None, TOKENS[: 2 * BT]))
        until(lambda: fleet.status()[1]["cached_blocks"] == 2, "the good stream's blocks")
        assert fleet.status()[0]["cached_blocks"] == 0
    finally:
        good.close()
        pub.close(0)
        ctx.term()


def test_the_masters_stream_says_exactly_what_the_pool_holds(feeds, tmp_path):
    """Store objects named as the connector names pages (``<namespace>/<block hash hex>``, one per TP rank):
    the router counts a block while one of its objects is left, and sees removals the engines never report."""
    e, other = Engine(vllm_events()), Engine(vllm_events())
    flags = {"events_port": 0, "events_buffer": 1000}
    try:
        with store_cluster(nodes=1, segment_size="8MiB", master_flags=flags, tmp=tmp_path) as c:
            h = hashes("vllm", 4)
            keys = {ns: [f"{ns}/{x.hex()}" for x in h] for ns in ("kvp1-rank0", "kvp1-rank1")}
            with StoreClient(ClientConfig(master=c.master)) as client:
                for ks in keys.values():  # stored before the router starts: its replay window says so
                    assert not any(client.batch_put(ks[:3], [b"p" * 512] * 3))
                fleet, f = feeds(kv_events=f"{e.endpoint},{other.endpoint}", store_master=c.master)
                until(lambda: fleet.pool_status()["pool_blocks"] == 3, "the replayed pool")
                assert fleet.pool_status()["pool_exact"] and f.status()["master_error"] == ""
                joined(fleet, e, 0)
                e.send(e.stored(h, None, TOKENS[: 4 * BT]))  # the engine names the blocks (its own cache)
                until(lambda: fleet.status()[0]["cached_blocks"] == 4, "the engine's blocks")
                assert predict(fleet, exclude={fleet.instances[0].url}) == (1, 0, 3)
                client.remove(keys["kvp1-rank0"][1])  # one rank's object of block 1 goes: the other's is left
                client.batch_put(keys["kvp1-rank0"][3:], [b"p" * 512])  # block 3 arrives (one rank)
                until(lambda: fleet.pool_status()["pool_blocks"] == 4, "block 3")
                assert predict(fleet, exclude={fleet.instances[0].url}) == (1, 0, 4)
                client.remove(keys["kvp1-rank1"][1])  # block 1's last object goes: the pool's prefix ends at it
                until(lambda: predict(fleet, exclude={fleet.instances[0].url}) == (1, 0, 1), "block 1 removed")
    finally:
        e.close()
        other.close()
