"""StoreClient against real master + store node processes on loopback: bytes and zero-copy forms, batch APIs,
exists/prefix semantics, remove, errors, and several client processes at once with every byte verified."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvplugins.errors import BufferNotRegistered, KeyNotFound, SizeMismatch, StoreError
from kvplugins.store import ClientConfig, StoreClient

WORKER = Path(__file__).with_name("client_worker.py")


def test_put_get_bytes_roundtrip_and_existing_key_is_noop(client):
    data = np.random.default_rng(1).bytes(300_000)
    client.put("t1/a", data)
    assert client.get("t1/a") == data
    client.put("t1/a", b"other bytes")  # complete key: no-op success, old bytes kept
    assert client.get("t1/a") == data
    with pytest.raises(KeyNotFound):
        client.get("t1/missing")


def test_zero_copy_gather_and_scatter(client):
    src = np.random.default_rng(2).integers(0, 256, 1 << 16, dtype=np.uint8)
    r = client.register_buffer(src)
    client.put_from("t2/x", [(r.addr + 10, 1000), (r.addr + 5000, 3000), (r.addr + 60000, 5)])
    dst = np.zeros(8192, dtype=np.uint8)
    d = client.register_buffer(dst)
    client.get_into("t2/x", [(d.addr + 4000, 2500), (d.addr, 1505)])  # scatter out of order
    want = np.concatenate([src[10:1010], src[5000:8000], src[60000:60005]])
    assert (dst[4000:6500] == want[:2500]).all() and (dst[:1505] == want[2500:]).all()
    with pytest.raises(SizeMismatch):
        client.get_into("t2/x", [(d.addr, 100)])
    with pytest.raises(BufferNotRegistered):
        client.put_from("t2/y", [(np.zeros(64, np.uint8).ctypes.data, 64)])
    client.unregister_buffer(dst)
    with pytest.raises(BufferNotRegistered):
        client.get_into("t2/x", [(d.addr, 4005)])


def test_batch_forms_report_per_key(client):
    keys = [f"t3/{i}" for i in range(20)]
    datas = [bytes([i]) * (100 + i * 1000) for i in range(20)]
    assert client.batch_put(keys, datas) == [None] * 20
    got = client.batch_get(keys[:5] + ["t3/none"] + keys[5:])
    assert got[:5] == datas[:5] and isinstance(got[5], KeyNotFound) and got[6:] == datas[5:]
    dst = np.zeros(sum(len(d) for d in datas[:3]) + 7, dtype=np.uint8)
    r = client.register_buffer(dst)
    spans = [[(r.addr, len(datas[0]))], [(r.addr + len(datas[0]), len(datas[1]))], [(r.addr, 7)]]
    res = client.batch_get_into([keys[0], keys[1], keys[2]], spans)
    assert res[:2] == [None, None] and isinstance(res[2], SizeMismatch)
    assert bytes(dst[: len(datas[0])]) == datas[0]
    assert isinstance(client.batch_put(["t3/empty"], [b""])[0], StoreError)


def test_exists_prefix_and_remove(client):
    client.batch_put(["t4/0", "t4/1", "t4/3"], [b"a", b"b", b"d"])
    assert client.batch_exists(["t4/0", "t4/1", "t4/2", "t4/3"]) == [True, True, False, True]
    assert client.batch_exists_prefix(["t4/0", "t4/1", "t4/2", "t4/3"]) == 2
    assert client.batch_exists_prefix(["t4/2", "t4/0"]) == 0 and client.batch_exists_prefix([]) == 0
    client.remove("t4/1")
    assert not client.exists("t4/1") and client.batch_exists_prefix(["t4/0", "t4/1"]) == 1
    with pytest.raises(KeyNotFound):
        client.remove("t4/1")
    res = client.batch_remove(["t4/0", "t4/nope"])
    assert res[0] is None and isinstance(res[1], KeyNotFound)
    client.put("t4/1", b"again")  # a removed key can be put again
    assert client.get("t4/1") == b"again"


def test_stats_count_hits_misses_bytes(client):
    client.put("t5/a", b"x" * 1000)
    client.get("t5/a")
    client.batch_get(["t5/a", "t5/none"])
    s = client.stats()
    assert s["hits"] >= 2 and s["misses"] >= 1 and s["bytes_got"] >= 2000 and s["bytes_put"] >= 1000
    assert s["get_batch_p50_us"] > 0 and s["master"] == client.master


def test_concurrent_client_processes_verify_every_byte(cluster):
    workers, keys = 3, 24
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), cluster.master, str(w), str(workers), str(keys)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(workers)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r == {"worker": r["worker"], "bad": 0, "misses": 0, "checked": workers * keys}


def test_client_contributes_its_own_segment():
    from helpers.cluster import master_process

    with master_process() as m:
        with StoreClient(ClientConfig(master=m.address, segment_size="4MiB")) as c:
            c.put("own/a", b"z" * 100_000)
            assert c.get("own/a") == b"z" * 100_000
            assert c.stats()["segment"]
            with StoreClient(ClientConfig(master=m.address)) as other:  # another process-less client reads it
                assert other.get("own/a") == b"z" * 100_000


def test_transfer_transports_env_reaches_a_default_client(cluster, monkeypatch):
    """One name per setting (issue #33): KVPLUGINS_TRANSFER_TRANSPORTS decides what a client built with default
    settings offers (its own ``transports`` is '' = unset); before, ClientConfig's default shm,rdma,tcp
    overrode it and the bytes went over shm. An explicit ClientConfig.transports still wins."""
    data = np.random.default_rng(7).bytes(100_000)
    monkeypatch.setenv("KVPLUGINS_TRANSFER_TRANSPORTS", "tcp")
    with StoreClient(ClientConfig(master=cluster.master)) as c:
        c.put("tenv/a", data)
        assert c.get("tenv/a") == data
        moved = c.transfer_stats()
    assert moved["tcp"]["bytes"] == 2 * len(data) and "shm" not in moved, moved  # shm not even offered
    with StoreClient(ClientConfig(master=cluster.master, transports="shm,tcp")) as c:
        assert c.get("tenv/a") == data
        moved = c.transfer_stats()
    assert moved["shm"]["bytes"] == len(data) and moved["tcp"]["bytes"] == 0, moved
