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
from kvplugins.store.client import store_client
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


def test_put_session_grants_never_ended_are_pruned_and_a_write_without_one_is_refused(monkeypatch):
    """A put session the caller never ends leaves its write grant behind; once past GRANTS_PRUNED_PAST grants
    the expired ones go (memory stays bounded), and a range write of a key with no grant is refused, never
    sent without a deadline."""
    monkeypatch.setattr(store_client, "GRANTS_PRUNED_PAST", 8)
    flags = {"put_timeout_ms": PUT_TIMEOUT_MS}
    with store_cluster(nodes=1, segment_size="1MiB", master_flags=flags, node_flags={"transports": "tcp"}) as c:
        with StoreClient(ClientConfig(master=c.master, transports="tcp")) as client:
            started = client.put_start([f"left/{i}" for i in range(8)], [4096] * 8)
            assert [code for code, _ in started] == [protocol.OK] * 8
            time.sleep(PUT_TIMEOUT_MS / 1000 + 0.1)  # every grant has expired
            [(code, locs)] = client.put_start(["fresh"], [4096])
            assert code == protocol.OK and sorted(client._grants) == ["fresh"]  # the 8 expired ones were pruned
            buf = np.zeros(4096, dtype=np.uint8)
            base = client.register_buffer(buf).addr
            [stale, ok] = client.transfer_ranges(
                "write", ["left/0", "fresh"], [[(base, 4096)], [(base, 4096)]], [[0], [0]], {0: started[0][1], 1: locs}
            )
            assert isinstance(stale, TransferFailed) and "no write grant" in str(stale) and ok is None
