"""A write into space the master granted lands only while the grant holds (issue #34): the master reclaims a put
not committed within put_timeout_ms and may hand its space to another put; a writer paused past that (SIGSTOP,
a stall) must then write nothing, or it overwrites another object's bytes (the cluster runs' corrupt replicas).
Real master and node processes, over TCP and shm; the pause is a real sleep of the writer."""

import time

import numpy as np
import pytest

from helpers.cluster import store_cluster
from kvplugins.errors import TransferFailed
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.wire import protocol

PUT_TIMEOUT_MS = 1000


@pytest.mark.parametrize("transports", ["tcp", "shm,tcp"])
def test_a_writer_paused_past_put_timeout_writes_nothing_over_the_next_put(transports):
    size = 64 << 10
    flags = {"put_timeout_ms": PUT_TIMEOUT_MS}
    with store_cluster(nodes=1, segment_size="1MiB", master_flags=flags, node_flags={"transports": transports}) as c:
        cfg = ClientConfig(master=c.master, transports=transports)
        with StoreClient(cfg) as late, StoreClient(cfg) as other:
            [(code, locs)] = late.put_start(["late"], [size])
            assert code == protocol.OK
            time.sleep(PUT_TIMEOUT_MS / 1000 + 0.6)  # paused: the master reclaims "late" in its sweep
            mine = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
            assert other.batch_put([f"next{i}" for i in range(8)], [mine] * 8) == [None] * 8
            stale = np.full(size, 0xEE, dtype=np.uint8)
            base = late.register_buffer(stale).addr
            [err] = late.transfer_ranges("write", ["late"], [[(base, size)]], [[0]], {0: locs})
            assert isinstance(err, TransferFailed) and "granted" in str(err)
            assert other.batch_get([f"next{i}" for i in range(8)]) == [mine] * 8
            assert other.stats()["checksum_errors"] == 0
