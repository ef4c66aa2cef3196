"""Nodes joining and dying at run time, on real processes: a SIGKILLed node's segment is suspect (no placement)
within 3 s with the default timeouts (heartbeat every 500 ms, suspect after 2 s of silence) and leaves ``status``
after the suspect grace, and a node added while clients run takes new puts (most free first, or by name as the
preferred segment)."""

import time

from helpers.cluster import store_cluster
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.placement import PutConfig
from kvplugins.store.client.rpc import RawRpcClient

OBJ = 64 << 10


def segment_names(rpc) -> set[str]:
    return {s["name"] for s in rpc.call("status")["segments"]}


def suspect(rpc) -> set[str]:
    return {s["name"] for s in rpc.call("status")["segments"] if s["suspect"]}


def test_dead_node_takes_no_placement_within_3_seconds_and_leaves_after_the_grace():
    grace_ms = 1000  # suspect_grace_ms (default 30 s): how long a silent node may still come back
    with store_cluster(nodes=2, segment_size="4MiB", master_flags={"suspect_grace_ms": grace_ms}) as c:
        rpc = RawRpcClient(c.master, 2000)
        victim, survivor = c.nodes[0], c.nodes[1]
        assert segment_names(rpc) == {victim.address, survivor.address}
        t0 = time.monotonic()
        victim.kill()  # SIGKILL: no unregister
        while victim.address not in suspect(rpc):
            assert time.monotonic() - t0 < 3.0, "dead segment still takes placements after 3 s"
            time.sleep(0.05)
        while victim.address in segment_names(rpc):
            assert time.monotonic() - t0 < 3.0 + grace_ms / 1000, "dead segment still listed after the grace"
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert segment_names(rpc) == {survivor.address} and suspect(rpc) == set()
        assert rpc.call("status")["segments_lost"] == 1
        time.sleep(max(0.0, 2.6 - took))  # the live node is never timed out
        assert segment_names(rpc) == {survivor.address} and suspect(rpc) == set()
        rpc.close()


def test_node_added_at_run_time_takes_new_puts():
    with store_cluster(nodes=1, segment_size="4MiB") as c, StoreClient(ClientConfig(master=c.master)) as client:
        old = [f"old/{i}" for i in range(20)]
        assert client.batch_put(old, [bytes([i]) * OBJ for i in range(20)]) == [None] * 20
        new_node = c.add_node("4MiB")
        new = [f"new/{i}" for i in range(20)]
        assert client.batch_put(new, [bytes([i]) * OBJ for i in range(20)]) == [None] * 20
        objects = {s["name"]: s["objects"] for s in client._rpc.call("status")["segments"]}
        assert objects[new_node.address] >= 10  # the empty newcomer is the most free
        client.put("pref", b"p" * OBJ, PutConfig(preferred_segment=new_node.address))
        assert client._rpc.call("get", ["pref"])[0][1][1][0][0] == new_node.address
        assert client.batch_get(old + new) == [bytes([i]) * OBJ for i in range(20)] * 2
