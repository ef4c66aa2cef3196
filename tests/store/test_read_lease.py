"""A store read that ends after its lease never returns its bytes (the object's space may hold another object by
then), and only the late entries are read again under a new lease (issue #34: a 13,494-key get on a loaded CI
host ran past the sharded store's 1 s lease, and every key of it failed, those read in time too). Real master and
node processes over TCP; the stall is a real SIGSTOP of the node serving part of the batch (over shm the client
copies from the segment itself, so a stopped node would not stall the read)."""

import signal
import threading

import numpy as np
import pytest

from helpers.cluster import store_cluster
from kvplugins.errors import LeaseExpired
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.client.store_client import LEASE_ROUNDS

LEASE_MS = 300


def _fill(client, n: int, size: int) -> tuple[list[str], list[bytes]]:
    rng = np.random.default_rng(n)
    keys = [f"lease/{n}/{i}" for i in range(n)]
    datas = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in keys]
    assert client.batch_put(keys, datas) == [None] * n
    return keys, datas


@pytest.mark.parametrize("n", [64, 2000])  # the per-key path and the column path of a big batch
def test_a_read_stalled_past_its_lease_is_read_again_under_a_new_one(n):
    flags = {"lease_ttl_ms": LEASE_MS}
    with store_cluster(nodes=2, segment_size="8MiB", master_flags=flags, node_flags={"transports": "tcp"}) as c:
        with StoreClient(ClientConfig(master=c.master, transports="tcp")) as client:
            keys, datas = _fill(client, n, 2048)
            segments = {v[1][0][0] for _, v in client._rpc.call("get", keys)}
            assert len(segments) == 2, segments  # the batch reads from both nodes
            stalled = c.nodes[1].popen
            stalled.send_signal(signal.SIGSTOP)
            resume = threading.Timer(2 * LEASE_MS / 1000, stalled.send_signal, [signal.SIGCONT])
            resume.start()
            try:
                got = client.batch_get(keys)
            finally:
                resume.join()
            assert got == datas  # the late entries were read again; none failed, none stale
            st = client.stats()
            assert 0 < st["lease_rereads"] <= n, st  # only the late entries, at most once each here
            assert st["checksum_errors"] == 0 and st["errors"] == 0 and st["misses"] == 0, st


def test_a_read_always_past_its_lease_fails_with_lease_expired_never_stale_bytes():
    # a 1 ms lease: no transfer group of 16 MiB over TCP ends within it, in any round
    flags = {"lease_ttl_ms": 1}
    with store_cluster(nodes=1, segment_size="24MiB", master_flags=flags, node_flags={"transports": "tcp"}) as c:
        with StoreClient(ClientConfig(master=c.master, transports="tcp")) as client:
            keys, datas = _fill(client, 64, 256 << 10)
            got = client.batch_get(keys)
            assert all(isinstance(g, LeaseExpired) for g in got), [type(g).__name__ for g in got][:5]
            assert "after its lease" in str(got[0])
            st = client.stats()
            assert st["lease_rereads"] == LEASE_ROUNDS * len(keys), st
            assert st["checksum_errors"] == 0 and st["corrupt_reported"] == 0, st  # a late read proves nothing
