"""A store node SIGKILLed in the middle of a batch workload with replicas=2, on real processes, over both
transports: no operation outlives its timeouts, every object acknowledged with two replicas keeps being served
by the surviving one (during the failure and after the master removed the dead segment), and single-replica
objects that lived on the dead node are misses — never wrong bytes."""

import threading
import time

import pytest

from helpers.cluster import store_cluster
from kvplugins.errors import KeyNotFound
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.placement import PutConfig

OBJ = 4 << 10
BATCH = 16
PAUSE_S = 0.05  # between rounds: ~60 rounds x 16 keys x 2 replicas fit the pool (no eviction)
TIMEOUT_MS = 1500  # transfer and RPC timeout: the bound every operation must respect


def value(key: str) -> bytes:
    return key.encode().ljust(OBJ, b".")


def workload(client, safe: list[str], stop: threading.Event, log: dict) -> None:
    """Alternate a batch put of new keys and a batch get of ``safe`` keys until ``stop``; records the longest
    operation, acknowledged keys, and any get that did not return the exact bytes."""
    n = 0
    while not stop.wait(PAUSE_S) and n < 100:
        keys = [f"live/{n}/{i}" for i in range(BATCH)]
        t0 = time.monotonic()
        out = client.batch_put(keys, [value(k) for k in keys])
        log["longest"] = max(log["longest"], time.monotonic() - t0)
        log["acked"] += [k for k, e in zip(keys, out) if e is None]
        log["failed_puts"] += sum(e is not None for e in out)
        t0 = time.monotonic()
        got = client.batch_get(safe[(n * BATCH) % len(safe) :][:BATCH])
        log["longest"] = max(log["longest"], time.monotonic() - t0)
        log["bad_gets"] += [g for g in got if not isinstance(g, bytes) or g[:5] != b"safe/"]
        n += 1


@pytest.mark.parametrize("transports", ["shm,tcp", "tcp"])
def test_node_killed_mid_batch_replicas_serve_rest_are_misses(transports):
    with (
        store_cluster(nodes=3, segment_size="8MiB", node_flags={"transports": transports}) as c,
        StoreClient(
            ClientConfig(
                master=c.master,
                replicas=2,
                transports=transports,
                transfer_timeout_ms=TIMEOUT_MS,
                rpc_timeout_ms=TIMEOUT_MS,
            )
        ) as client,
    ):
        safe = [f"safe/{i}" for i in range(64)]
        single = [f"single/{i}" for i in range(48)]
        assert client.batch_put(safe, [value(k) for k in safe]) == [None] * 64
        assert client.batch_put(single, [value(k) for k in single], PutConfig(replicas=1)) == [None] * 48
        victim = c.nodes[0].address
        on_victim = {k for k, (_, v) in zip(single, client._rpc.call("get", single)) if v[1][0][0] == victim}
        assert 0 < len(on_victim) < len(single)
        log = {"longest": 0.0, "acked": [], "failed_puts": 0, "bad_gets": []}
        stop = threading.Event()
        worker = threading.Thread(target=workload, args=(client, safe, stop, log))
        worker.start()
        time.sleep(0.3)
        c.nodes[0].kill()  # SIGKILL while batches run
        deadline = time.monotonic() + 5
        while victim not in {s["name"] for s in client._rpc.call("status")["segments"] if s["suspect"]}:
            assert time.monotonic() < deadline, "dead segment never suspect"
            time.sleep(0.1)
        time.sleep(0.5)  # batches after it is suspect too
        stop.set()
        worker.join(timeout=2 * TIMEOUT_MS / 1000 + 5)
        assert not worker.is_alive(), "an operation hung"
        assert log["longest"] < 2 * TIMEOUT_MS / 1000 + 1.0  # put: transfer + commit RPC at most
        assert log["bad_gets"] == []  # two replicas: always served, exact
        assert len(log["acked"]) > 0
        assert client._rpc.call("status")["evictions"] == 0  # so every acknowledged put must read
        assert client.batch_get(log["acked"]) == [value(k) for k in log["acked"]]
        assert client.batch_get(safe) == [value(k) for k in safe]
        got = client.batch_get(single)
        misses = {k for k, g in zip(single, got) if isinstance(g, KeyNotFound)}
        assert misses == on_victim
        assert all(g == value(k) for k, g in zip(single, got) if k not in misses)
