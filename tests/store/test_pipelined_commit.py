"""Pipelined put_commit (ClientConfig.wait_commit=False) against real master + node processes: the writer reads
its own writes at once, other clients see the object once the master processed the commit (flush() waits for
that), a refused commit is counted and reads as a miss, a lost master reports every deferred request; and big
single-span batches (the numpy path) land byte-exact with keys spread over both segments."""

import numpy as np
import pytest

from helpers.cluster import master_process
from kvplugins.errors import KeyNotFound, MasterUnreachable
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.client.rpc import RawRpcClient


def test_writer_reads_its_writes_and_others_see_them_after_flush(cluster):
    with (
        StoreClient(ClientConfig(master=cluster.master, wait_commit=False)) as w,
        StoreClient(ClientConfig(master=cluster.master)) as r,
    ):
        src = np.random.default_rng(3).integers(0, 256, 32 * 4096, dtype=np.uint8)
        reg = w.register_buffer(src)
        for i in range(20):
            w.put_from(f"pc/{i}", [(reg.addr + i * 4096, 4096)])
            assert w.exists(f"pc/{i}")  # same connection: the commit came first
        keys = [f"pc/b{i}" for i in range(12)]
        assert w.batch_put_from(keys, [[(reg.addr + i * 4096, 4096)] for i in range(12)]) == [None] * 12
        w.flush()
        assert r.batch_exists([f"pc/{i}" for i in range(20)] + keys) == [True] * 32
        assert r.get("pc/7") == src[7 * 4096 : 8 * 4096].tobytes()
        assert w.stats()["commit_failures"] == 0


def test_deferred_reply_is_read_before_the_next_call(cluster):
    rpc = RawRpcClient(cluster.master, 3000)
    seen = []
    try:
        rpc.send_deferred("put_commit", ["pc/never-started"], on_reply=lambda ok, p: seen.append((ok, p)))
        assert seen == []
        assert rpc.call("exists", ["pc/never-started"]) == [False]
        assert seen and seen[0][0] is True and seen[0][1][0][0] == 5  # EXPIRED: no pending put
        rpc.flush()  # nothing left: returns at once
    finally:
        rpc.close()


def test_refused_pipelined_commit_is_a_counted_miss(cluster):
    with StoreClient(ClientConfig(master=cluster.master, wait_commit=False)) as w:
        w._commit_replied(["pc/x"], True, [[5, "no pending put"]])  # what a refused commit reply does
        assert w.stats()["commit_failures"] == 1
        with pytest.raises(KeyNotFound):
            w.get("pc/x")


def test_master_lost_with_deferred_requests():
    with master_process() as m:
        rpc = RawRpcClient(m.address, 500)
        rpc.call("info")
        m.kill()
    seen = []
    try:
        rpc.send_deferred("exists", ["a"], on_reply=lambda ok, p: seen.append((ok, p)))
    except MasterUnreachable:
        pass  # refused at once: nothing was deferred
    else:
        with pytest.raises(MasterUnreachable):
            rpc.flush()
        assert len(seen) == 1 and seen[0][0] is False and "lost" in seen[0][1]
    rpc.close()


@pytest.mark.parametrize("wait_commit", [True, False])
def test_big_single_span_batches_are_exact(cluster, wait_commit, put_pages):
    with StoreClient(ClientConfig(master=cluster.master, wait_commit=wait_commit)) as c:
        n, size = 96, 8192
        src, dst, b, keys = put_pages(c, f"pc/big{wait_commit}", n, size, seed=4)
        order = np.random.default_rng(5).permutation(n)  # scatter back in another order
        out = c.batch_get_into([keys[i] for i in order], [[(b + i * size, size)] for i in order])
        assert out == [None] * n
        assert np.array_equal(dst, src)
        segs = {s["name"]: s["objects"] for s in c._rpc.call("status")["segments"]}
        assert len(segs) == 2 and all(v > 0 for v in segs.values())  # the batch spread over both
