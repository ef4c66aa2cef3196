"""Store gets and slab puts from/into a same-host segment in one native call each (native.get_many / put_many,
issue #35), on real processes: a master and a store node. The objects the native calls move are counted in the
shm transport's table (ShmMaps.counts), so each test can tell which path served it: the common case must be
native, and everything the native call does not finish (a first read before the mapping exists, a miss, a size
mismatch, a flipped byte, a dead node, read-only memory) must end exactly as the Python path ends it."""

import numpy as np
import pytest

from helpers.cluster import store_cluster
from helpers.corrupt import flip_stored_byte
from helpers.objects import stored
from kvplugins.errors import (
    BufferNotRegistered,
    ChecksumMismatch,
    KeyNotFound,
    MasterUnreachable,
    SizeMismatch,
    StoreError,
    TransferFailed,
)
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.client.store_client import NATIVE_MAX_BYTES

SIZE = 4096


@pytest.fixture(scope="module")
def pool():
    """A master and one node whose 64 MiB segment offers slabs (1/64 of it: one-round-trip puts)."""
    with store_cluster(nodes=1, segment_size="64MiB", node_flags={"transports": "shm,tcp"}) as c:
        yield c


def native_objects(client) -> int:
    return client._engine.shm_maps().counts()[0]


def test_gets_after_the_first_are_one_native_call_each(pool):
    with StoreClient(ClientConfig(master=pool.master, transports="shm,tcp")) as c:
        src, dst, keys = stored(c, "one/hot", 20, SIZE, 1)
        base = dst.ctypes.data
        before = native_objects(c)  # the puts mapped the node's segment
        for i, k in enumerate(keys):
            c.get_into(k, [(base + i * SIZE, SIZE)])
        assert np.array_equal(dst, src)
        assert native_objects(c) - before == len(keys)
        dst[:] = 0
        c.get_into(keys[3], [(base, 1000), (base + 3 * SIZE, SIZE - 1000)])  # two spans: hashed after the copy
        assert np.array_equal(dst[:1000], src[3 * SIZE : 3 * SIZE + 1000])
        assert np.array_equal(dst[3 * SIZE : 4 * SIZE - 1000], src[3 * SIZE + 1000 : 4 * SIZE])
        assert native_objects(c) - before == len(keys) + 1
        shm = c.transfer_stats()["shm"]
        assert shm["entries"] >= 2 * len(keys) + 1 and shm["bytes"] >= (2 * len(keys) + 1) * SIZE
        assert c.stats()["gets"] == len(keys) + 1 and c.stats()["hits"] == len(keys) + 1


def test_what_the_native_call_leaves_ends_as_on_the_python_path(pool):
    with StoreClient(ClientConfig(master=pool.master, transports="shm,tcp")) as c:
        src, dst, keys = stored(c, "one/edge", 4, SIZE, 2)
        base, n0 = dst.ctypes.data, native_objects(c)
        with pytest.raises(KeyNotFound):
            c.get_into("one/edge/absent", [(base, SIZE)])
        with pytest.raises(SizeMismatch, match="object is 4096 bytes"):
            c.get_into(keys[0], [(base, SIZE - 1)])
        flip_stored_byte(c, keys[1])
        with pytest.raises(ChecksumMismatch):
            c.get_into(keys[1], [(base, SIZE)])
        assert c.stats()["corrupt_reported"] == 1 and c.batch_exists([keys[1]]) == [False]
        frozen = np.frombuffer(src.tobytes(), dtype=np.uint8)  # bytes: read-only memory
        c.register_buffer(frozen)
        with pytest.raises(TransferFailed, match="read-only"):
            c.get_into(keys[2], [(frozen.ctypes.data, SIZE)])
        assert native_objects(c) == n0  # none of them was finished natively
        c.get_into(keys[2], [(base, SIZE)])
        assert np.array_equal(dst[:SIZE], src[2 * SIZE : 3 * SIZE]) and native_objects(c) == n0 + 1
        # a batch over NATIVE_MAX_BYTES is not copied inside the native call (it would hold the master connection's
        # lock for the whole copy): the general path serves it, with the same bytes
        n = NATIVE_MAX_BYTES + SIZE
        big = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
        back = np.zeros_like(big)
        c.register_buffer(big)
        c.register_buffer(back)
        c.put_from("one/edge/big", [(big.ctypes.data, n)])
        n1 = native_objects(c)
        c.get_into("one/edge/big", [(back.ctypes.data, n)])
        assert np.array_equal(back, big) and native_objects(c) == n1


def test_a_dead_node_or_master_is_an_error_not_a_hang_or_stale_bytes():
    with store_cluster(nodes=1, segment_size="8MiB", node_flags={"transports": "shm,tcp"}) as cluster:
        with StoreClient(ClientConfig(master=cluster.master, transports="shm,tcp", rpc_timeout_ms=2000)) as c:
            src, dst, keys = stored(c, "one/dead", 2, SIZE, 3)
            base = dst.ctypes.data
            c.get_into(keys[0], [(base, SIZE)])
            n0 = native_objects(c)
            cluster.nodes[0].kill()
            with pytest.raises((TransferFailed, KeyNotFound)):  # the master still lists it, or dropped it
                c.get_into(keys[1], [(base + SIZE, SIZE)])
            assert not dst[SIZE:].any() and native_objects(c) == n0
            cluster.master_proc.kill()
            with pytest.raises(MasterUnreachable):
                c.get_into(keys[0], [(base, SIZE)])


def test_a_batch_is_one_native_call_and_its_odd_keys_end_as_on_the_python_path(pool):
    with StoreClient(ClientConfig(master=pool.master, transports="shm,tcp")) as c:
        src, dst, keys = stored(c, "one/batch", 40, SIZE, 4)  # warms the mapping and the slab
        n0 = native_objects(c)
        more = [f"one/batch/more/{i}" for i in range(24)]
        a = src.ctypes.data
        assert c.batch_put_from(more, [[(a + i * SIZE, SIZE)] for i in range(24)]) == [None] * 24
        assert native_objects(c) - n0 == 24  # the slab put of the whole batch: native
        # an empty object or a span outside registered memory: the batch takes the general path, which names them
        odd = c.batch_put_from(["one/batch/e", "one/batch/u", "one/batch/ok"], [[(a, 0)], [(8, SIZE)], [(a, SIZE)]])
        assert "empty object" in str(odd[0]) and isinstance(odd[1], BufferNotRegistered) and odd[2] is None
        assert native_objects(c) - n0 == 25 and c.batch_exists(["one/batch/e", "one/batch/u"]) == [False, False]
        flip_stored_byte(c, keys[5])
        asked = keys + ["one/batch/absent"]
        base = dst.ctypes.data
        spans = [[(base + i * SIZE, SIZE)] for i in range(40)] + [[(base, SIZE)]]
        spans[7] = [(base + 7 * SIZE, SIZE - 8)]  # too short for its object
        n1 = native_objects(c)
        out = c.batch_get_into(asked, spans)
        assert isinstance(out[5], ChecksumMismatch) and isinstance(out[7], SizeMismatch)
        assert isinstance(out[40], KeyNotFound) and not isinstance(out[40], ChecksumMismatch)
        good = [i for i in range(40) if i not in (5, 7)]
        assert [out[i] for i in good] == [None] * len(good)
        assert all(np.array_equal(dst[i * SIZE : (i + 1) * SIZE], src[i * SIZE : (i + 1) * SIZE]) for i in good)
        assert native_objects(c) - n1 == len(good)
        assert c.stats()["corrupt_reported"] == 1
        # a span in read-only memory, or an address that is no Python int: the whole batch takes the general path
        frozen = np.frombuffer(src.tobytes(), dtype=np.uint8)
        c.register_buffer(frozen)
        dst[: 3 * SIZE] = 0
        out = c.batch_get_into(keys[:2], [[(frozen.ctypes.data, SIZE)], [(base, SIZE)]])
        assert isinstance(out[0], TransferFailed) and "read-only" in str(out[0]) and out[1] is None
        out = c.batch_get_into(keys[1:3], [[(np.uint64(base + SIZE), SIZE)], [(base + 2 * SIZE, SIZE)]])
        assert out == [None, None] and np.array_equal(dst[:SIZE], src[SIZE : 2 * SIZE])  # the first batch's key 1
        assert np.array_equal(dst[SIZE : 3 * SIZE], src[SIZE : 3 * SIZE])
        assert native_objects(c) - n1 == len(good)
        dst[3 * SIZE : 5 * SIZE] = 0  # a key in two spans (a tuple), the next in one: native
        out = c.batch_get_into(keys[3:5], [((base + 4 * SIZE, 100), (base + 3 * SIZE, SIZE - 100)), [(base, SIZE)]])
        assert out == [None, None] and native_objects(c) - n1 == len(good) + 2
        assert np.array_equal(dst[4 * SIZE : 4 * SIZE + 100], src[3 * SIZE : 3 * SIZE + 100])
        assert np.array_equal(dst[3 * SIZE : 4 * SIZE - 100], src[3 * SIZE + 100 : 4 * SIZE])
        assert np.array_equal(dst[:SIZE], src[4 * SIZE : 5 * SIZE])


def test_exists_is_one_native_exchange_with_the_python_answers(pool, monkeypatch):
    with StoreClient(ClientConfig(master=pool.master, transports="shm,tcp")) as c:
        _, _, keys = stored(c, "one/exists", 3, SIZE, 5)
        asked = [keys[0], "one/exists/absent", keys[2], keys[1]]
        python = list(c._rpc.call("exists", asked))
        calls: list[str] = []
        real = c._rpc.call
        monkeypatch.setattr(c._rpc, "call", lambda op, *a, **kw: (calls.append(op), real(op, *a, **kw))[1])
        assert c.batch_exists(asked) == python == [True, False, True, True]
        assert c.exists(keys[0]) and not c.exists("one/exists/absent")
        assert calls == []  # no Python RPC: each was one native exchange
        with pytest.raises(StoreError, match="max_key_bytes"):  # the master's refusal, raised as the RPC raises it
            c.batch_exists(["k" * (1 << 16)])
        assert calls == [] and c.batch_exists(asked) == python  # the connection is still in step
