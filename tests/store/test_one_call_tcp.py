"""Store gets and slab puts over TCP in one native call each (issue #35): the master's RPC and the node's frames
in C++ on the TCP transport's pooled connections (native/src/tcp/peers.h, native/src/store/one_op.h), on real
processes: a master and a store node offering TCP only. The objects moved that way are counted in the transport's
stats ("native_entries"), so each test can tell which path served it: the common case must be native, and what
the native call does not finish (a first read before a pooled connection exists, a miss, a size mismatch, a
flipped byte, a connection the node closed, a stalled or dead node) must end exactly as the Python path ends it."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from helpers.cluster import store_cluster
from helpers.corrupt import flip_stored_byte
from helpers.objects import stored
from kvplugins.errors import ChecksumMismatch, KeyNotFound, SizeMismatch, TransferFailed
from kvplugins.store import ClientConfig, StoreClient

SIZE = 4096


@pytest.fixture(scope="module")
def pool():
    """A master and one node offering TCP only, whose 64 MiB segment offers slabs (one-round-trip puts)."""
    with store_cluster(nodes=1, segment_size="64MiB", node_flags={"transports": "tcp"}) as c:
        yield c


def native_objects(client) -> int:
    return client.transfer_stats()["tcp"]["native_entries"]


def test_gets_and_puts_after_the_first_are_native_over_tcp(pool):
    with StoreClient(ClientConfig(master=pool.master, transports="tcp")) as c:
        src, dst, keys = stored(c, "tcp/hot", 32, SIZE, 1)  # the first write pools a connection and routes the segment
        n0 = native_objects(c)
        base = dst.ctypes.data
        for i, k in enumerate(keys):
            c.get_into(k, [(base + i * SIZE, SIZE)])
        assert np.array_equal(dst, src) and native_objects(c) - n0 == len(keys)
        dst[:] = 0
        assert c.batch_get_into(keys, [[(base + i * SIZE, SIZE)] for i in range(32)]) == [None] * 32
        assert np.array_equal(dst, src) and native_objects(c) - n0 == 2 * len(keys)
        dst[:] = 0
        c.get_into(keys[3], [(base, 1000), (base + 3 * SIZE, SIZE - 1000)])  # two spans, hashed after the frames
        assert np.array_equal(dst[:1000], src[3 * SIZE : 3 * SIZE + 1000])
        assert np.array_equal(dst[3 * SIZE : 4 * SIZE - 1000], src[3 * SIZE + 1000 : 4 * SIZE])
        more = [f"tcp/hot/more/{i}" for i in range(16)]
        a = src.ctypes.data
        n1 = native_objects(c)
        assert c.batch_put_from(more, [[(a + i * SIZE, SIZE)] for i in range(16)]) == [None] * 16
        assert native_objects(c) - n1 == 16  # the slab write over TCP, then the put: native
        with StoreClient(ClientConfig(master=pool.master, transports="tcp")) as other:  # another process's view
            back = np.zeros(16 * SIZE, dtype=np.uint8)
            other.register_buffer(back)
            b = back.ctypes.data
            assert other.batch_get_into(more, [[(b + i * SIZE, SIZE)] for i in range(16)]) == [None] * 16
            assert np.array_equal(back, src[: 16 * SIZE])


def test_what_the_native_call_leaves_ends_as_on_the_python_path(pool):
    with StoreClient(ClientConfig(master=pool.master, transports="tcp")) as c:
        src, dst, keys = stored(c, "tcp/edge", 4, SIZE, 2)
        base, n0 = dst.ctypes.data, native_objects(c)
        with pytest.raises(KeyNotFound):
            c.get_into("tcp/edge/absent", [(base, SIZE)])
        with pytest.raises(SizeMismatch, match="object is 4096 bytes"):
            c.get_into(keys[0], [(base, SIZE - 1)])
        flip_stored_byte(c, keys[1])
        with pytest.raises(ChecksumMismatch):  # read natively, mismatched, read again in Python: named there
            c.get_into(keys[1], [(base, SIZE)])
        assert c.stats()["corrupt_reported"] == 1 and c.batch_exists([keys[1]]) == [False]
        assert native_objects(c) == n0
        c.get_into(keys[2], [(base, SIZE)])
        assert np.array_equal(dst[:SIZE], src[2 * SIZE : 3 * SIZE]) and native_objects(c) == n0 + 1


def test_a_pooled_connection_the_node_closed_is_replaced_without_an_error(monkeypatch):
    monkeypatch.setenv("KVPLUGINS_TRANSFER_IDLE_TIMEOUT_MS", "300")  # the node closes idle connections fast
    with store_cluster(nodes=1, segment_size="8MiB", node_flags={"transports": "tcp"}) as cluster:
        with StoreClient(ClientConfig(master=cluster.master, transports="tcp")) as c:
            src, dst, keys = stored(c, "tcp/idle", 8, SIZE, 3)
            base = dst.ctypes.data
            c.get_into(keys[0], [(base, SIZE)])
            n0 = native_objects(c)
            time.sleep(1.0)  # every pooled connection is closed by the node now
            assert c.batch_get_into(keys, [[(base + i * SIZE, SIZE)] for i in range(8)]) == [None] * 8
            assert np.array_equal(dst, src) and native_objects(c) == n0  # the Python path reconnected
            dst[:] = 0
            assert c.batch_get_into(keys, [[(base + i * SIZE, SIZE)] for i in range(8)]) == [None] * 8
            assert np.array_equal(dst, src) and native_objects(c) == n0 + 8  # native again on the new connection


def test_a_stalled_node_fails_its_reads_in_time_and_never_holds_the_master_connection():
    with store_cluster(nodes=1, segment_size="8MiB", node_flags={"transports": "tcp"}) as cluster:
        cfg = ClientConfig(master=cluster.master, transports="tcp", transfer_timeout_ms=3000, rpc_timeout_ms=1000)
        with StoreClient(cfg) as c:
            src, dst, keys = stored(c, "tcp/stall", 2, SIZE, 4)
            base = dst.ctypes.data
            c.get_into(keys[0], [(base, SIZE)])
            os.kill(cluster.nodes[0].popen.pid, signal.SIGSTOP)
            try:
                got: dict = {}

                def read():
                    t = time.monotonic()
                    try:
                        c.get_into(keys[1], [(base + SIZE, SIZE)])
                    except (TransferFailed, KeyNotFound) as e:  # the master may deem the silent node suspect by then
                        got["error"] = e
                    got["s"] = time.monotonic() - t

                reader = threading.Thread(target=read)
                reader.start()
                time.sleep(0.3)  # the native read waits on the stalled node's frames now (3 s)
                t = time.monotonic()
                assert c.batch_exists(keys) == [True, True]  # the master's connection is not held meanwhile
                assert time.monotonic() - t < 1.0
                reader.join(15)
                assert not reader.is_alive() and "error" in got
                assert got["s"] < 2 * 3.0 + 2.0  # the native try and the Python one, each within the timeout
                assert not dst[SIZE:].any()  # no stale or partial bytes reported as read
            finally:
                os.kill(cluster.nodes[0].popen.pid, signal.SIGCONT)
