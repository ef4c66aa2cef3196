"""The disk tier with real master and node processes: offload on evict (watermark sweep), promote on hit with
checksums verified, a torn or corrupt file never reads back, a remove deletes the file, and the disk round trip
across a node restart (SIGKILL, then a new process on the same --disk-dir), and the KV events of offloads and
promotions."""

import time

import pytest

from helpers.cluster import store_cluster
from kvplugins.errors import KeyNotFound, StoreError
from kvplugins.security import load_secret
from kvplugins.security.curve import client_socket
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.wire import protocol
from kvplugins.store.node.disk import files
from kvplugins.store.node.disk.files import CorruptFile
from kvplugins.store.node.disk.store import DiskStore

OBJ = 64 << 10
# 4 MiB segment: above 20% (13 objects) the sweep offloads down to 10%
# grace 0: these tests drive offloads and evictions right after the puts; the grace is tested in test_churn.py;
# a killed node is removed at once (no suspect grace: tests/store/test_liveness.py)
MASTER = {
    "high_watermark": 0.2,
    "low_watermark": 0.1,
    "lease_ttl_ms": 1000,
    "heartbeat_timeout_ms": 1000,
    "eviction_grace_ms": 0,
    "suspect_grace_ms": 0,
}


def _data(i: int) -> bytes:
    return bytes([i % 251]) * (OBJ - 7) + i.to_bytes(7, "little")


def _wait(pred, what: str, timeout: float = 10.0):
    t0 = time.monotonic()
    while not (value := pred()):
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _put_and_offload(client, prefix: str, n: int) -> list[str]:
    """Put n objects (slowly enough for the sweep's offloads to keep up); wait until the sweep settled."""
    keys = [f"{prefix}/{i}" for i in range(n)]
    for i, k in enumerate(keys):
        client.put(k, _data(i))
        time.sleep(0.01)
    rpc = client._rpc
    _wait(lambda: rpc.call("status")["bytes_used"] <= 0.2 * (4 << 20) and not _in_flight(rpc), "offloads")
    return keys


def _in_flight(rpc) -> bool:
    s = rpc.call("status")
    return s["disk_flights"] > 0 or s["zombies"] > 0


@pytest.fixture
def disk_cluster(tmp_path):
    flags = {"disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB"}
    with store_cluster(
        nodes=1, segment_size="4MiB", master_flags=MASTER, node_flags=flags, tmp=tmp_path / "cluster"
    ) as c:
        c.disk = tmp_path / "disk"
        c.node_flags = flags
        yield c


# ---- the file format and the node-local store (no processes) -----------------------------------------------
def test_torn_and_corrupt_files_never_read_back(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    for k in ("a", "b", "c"):
        store.put(k, _data(ord(k)), files.checksum(_data(ord(k))))
    objects = tmp_path / "objects"
    path_a, path_b = objects / files.file_name("a"), objects / files.file_name("b")
    raw = bytearray(path_b.read_bytes())
    raw[-100] ^= 0xFF  # flip one object byte
    path_b.write_bytes(raw)
    path_a.write_bytes(path_a.read_bytes()[:-10])  # torn: cut short
    (tmp_path / "tmp" / "x.tmp").write_bytes(b"half a write")
    store = DiskStore(tmp_path, 1 << 20)  # "restart"
    assert store.stats()["disk_corrupt"] == 1 and not path_a.exists()  # torn file dropped at scan
    assert not list((tmp_path / "tmp").iterdir())
    dest = bytearray(OBJ)
    with pytest.raises(CorruptFile):
        store.read_into("b", memoryview(dest))
    assert not path_b.exists() and store.stats()["disk_corrupt"] == 2
    assert store.read_into("c", memoryview(dest)) == files.checksum(_data(ord("c"))) and dest == _data(ord("c"))
    assert [e[0] for e in store.entries()] == ["c"]


def test_capacity_evicts_least_recently_used_files(tmp_path):
    store = DiskStore(tmp_path, 3 * OBJ)
    for i in range(3):
        assert store.put(f"k{i}", _data(i), files.checksum(_data(i))) == []
    store.read_into("k0", memoryview(bytearray(OBJ)))  # k0 used: k1 is now least recently used
    assert store.put("k3", _data(3), files.checksum(_data(3))) == ["k1"]
    assert {e[0] for e in store.entries()} == {"k0", "k2", "k3"} and store.used == 3 * OBJ
    with pytest.raises(StoreError):
        store.put("big", bytes(4 * OBJ), 0)


# ---- real processes ---------------------------------------------------------------------------------------
def test_offload_on_evict_and_promote_on_hit(disk_cluster):
    with StoreClient(ClientConfig(master=disk_cluster.master)) as client:
        keys = _put_and_offload(client, "o", 24)
        status = client._rpc.call("status")
        assert status["offloads"] >= 10 and status["disk_objects"] == status["offloads"]
        assert status["objects"] == 24 and status["disk_bytes"] == status["disk_objects"] * OBJ
        assert len(list((disk_cluster.disk / "objects").glob("*/*.kvd"))) == status["disk_objects"]
        for i, k in enumerate(keys):  # single gets: the row-form answer
            assert client.get(k) == _data(i)
        after = client._rpc.call("status")
        # (promotions push usage over high again, so the sweep may offload a later key before it is read)
        assert after["promotions"] >= status["disk_objects"] and after["disk_hits"] >= after["promotions"]


def test_batch_get_promotes_in_column_form(disk_cluster):
    with StoreClient(ClientConfig(master=disk_cluster.master)) as client:
        keys = _put_and_offload(client, "b", 40)
        assert client._rpc.call("status")["disk_objects"] >= 20
        assert client.batch_get(keys) == [_data(i) for i in range(40)]  # > SMALL keys: column replies


def test_puts_never_wait_for_disk(disk_cluster):
    """Puts far faster than offloads: on-demand eviction drops (or frees objects already on disk) instead of
    waiting, so no put fails; every key then reads back its own bytes or is a miss, never other bytes."""
    with StoreClient(ClientConfig(master=disk_cluster.master)) as client:
        keys = [f"f/{i}" for i in range(160)]  # 2.5x the segment, in batches of 8, no pauses
        for j in range(0, 160, 8):
            assert client.batch_put(keys[j : j + 8], [_data(i) for i in range(j, j + 8)]) == [None] * 8
        got = client.batch_get(keys)
        assert all(v == _data(i) or isinstance(v, KeyNotFound) for i, v in enumerate(got))
        assert sum(v == _data(i) for i, v in enumerate(got)) >= 16
        files_on_disk = lambda: len(list((disk_cluster.disk / "objects").glob("*/*.kvd")))  # noqa: E731
        _wait(
            lambda: not _in_flight(client._rpc) and client._rpc.call("status")["disk_objects"] == files_on_disk(),
            "every file on disk known to the master (cancelled offloads' files deleted)",
        )


def test_corrupt_disk_file_is_a_miss_never_wrong_bytes(disk_cluster):
    with StoreClient(ClientConfig(master=disk_cluster.master)) as client:
        keys = _put_and_offload(client, "c", 24)
        on_disk = [k for k in keys if (disk_cluster.disk / "objects" / files.file_name(k)).exists()]
        assert len(on_disk) >= 10
        path = disk_cluster.disk / "objects" / files.file_name(on_disk[0])
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x01
        path.write_bytes(raw)
        with pytest.raises(KeyNotFound):
            client.get(on_disk[0])
        status = client._rpc.call("status")
        assert status["disk_corrupt"] == 1 and not path.exists()
        assert client.get(on_disk[1]) == _data(keys.index(on_disk[1]))  # the others still promote


def test_remove_deletes_the_disk_file(disk_cluster):
    with StoreClient(ClientConfig(master=disk_cluster.master)) as client:
        keys = _put_and_offload(client, "r", 24)
        victim = next(k for k in keys if (disk_cluster.disk / "objects" / files.file_name(k)).exists())
        client.remove(victim)
        _wait(lambda: not (disk_cluster.disk / "objects" / files.file_name(victim)).exists(), "file deleted")
        with pytest.raises(KeyNotFound):
            client.get(victim)


def test_disk_round_trip_across_node_restart(disk_cluster):
    c = disk_cluster
    with StoreClient(ClientConfig(master=c.master)) as client:
        keys = _put_and_offload(client, "t", 24)
        on_disk = {k for k in keys if (c.disk / "objects" / files.file_name(k)).exists()}
        assert len(on_disk) >= 10
        c.nodes[0].kill()  # SIGKILL: no unregister, files stay
        _wait(lambda: not client._rpc.call("status")["segments"], "dead node removed")
        assert client.batch_exists(keys) == [False] * 24  # the master forgot everything of that node
        c.add_node("4MiB", **c.node_flags)  # a new process on the same --disk-dir
        assert client.batch_exists(keys) == [k in on_disk for k in keys]  # re-announced at registration
        for k in sorted(on_disk):
            assert client.get(k) == _data(keys.index(k))
        assert client._rpc.call("status")["promotions"] == len(on_disk)


def test_promote_endpoint_requires_the_shared_secret(tmp_path, monkeypatch):
    from kvplugins.errors import AuthError
    from kvplugins.store.wire.protocol import ON_DISK
    from kvplugins.store.client.rpc import RawRpcClient

    token = tmp_path / "token"
    token.write_text("disk-tier-secret-" + "b2" * 16 + "\n")
    token.chmod(0o600)
    monkeypatch.delenv("KVPLUGINS_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("KVPLUGINS_AUTH_TOKEN_FILE", str(token))
    flags = {"disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB"}
    with (
        store_cluster(
            nodes=1, segment_size="4MiB", master_flags=MASTER, node_flags=flags, tmp=tmp_path / "cluster"
        ) as c,
        StoreClient(ClientConfig(master=c.master)) as client,
    ):
        keys = _put_and_offload(client, "s", 24)
        answers = client._rpc.call("get", keys)
        j = next(i for i, (code, _) in enumerate(answers) if code == ON_DISK)
        endpoint = answers[j][1][0]
        monkeypatch.delenv("KVPLUGINS_AUTH_TOKEN_FILE")  # a peer without the secret
        stranger = RawRpcClient(endpoint, 2000)
        with pytest.raises(AuthError):
            stranger.call("promote", [keys[j]])
        stranger.close()
        _wait(lambda: "refused disk-tier promote connection" in c.nodes[0].log_tail(), "the refusal logged")
        monkeypatch.setenv("KVPLUGINS_AUTH_TOKEN_FILE", str(token))
        assert client.get(keys[j]) == _data(j)  # the client holding the secret promotes


def test_fast_restart_before_the_old_segment_times_out(tmp_path):
    """SIGKILL and restart at once: the new process's disk is recognised (its ID file), its files are adopted, not
    deleted as stale, and objects whose DRAM copy died with the old process live on from the disk."""
    flags = {"disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB"}
    with (
        store_cluster(
            nodes=1,
            segment_size="4MiB",
            master_flags={**MASTER, "heartbeat_timeout_ms": 4000},
            node_flags=flags,
            tmp=tmp_path / "cluster",
        ) as c,
        StoreClient(ClientConfig(master=c.master)) as client,
    ):
        c.disk, c.node_flags = tmp_path / "disk", flags
        keys = _put_and_offload(client, "q", 24)
        c.nodes[0].kill()
        c.add_node("4MiB", **c.node_flags)
        assert len(client._rpc.call("status")["segments"]) == 2  # the old segment is still registered
        on_disk = {k for k in keys if (c.disk / "objects" / files.file_name(k)).exists()}
        _wait(lambda: len(client._rpc.call("status")["segments"]) == 1, "old segment timed out")
        assert on_disk and {k for k, ok in zip(keys, client.batch_exists(keys)) if ok} == on_disk
        assert {k for k in keys if (c.disk / "objects" / files.file_name(k)).exists()} == on_disk  # none deleted
        assert [client.get(k) for k in sorted(on_disk)] == [_data(keys.index(k)) for k in sorted(on_disk)]


def test_a_promoted_object_reads_from_disk_while_its_dram_replica_is_suspect(tmp_path):
    """An object promoted back to DRAM keeps its disk copy. Its node SIGKILLed and restarted at once on the same
    disk: the old segment stays registered but suspect (its DRAM replica is not read) for suspect_grace_ms, and a
    get of the object promotes it again from the new process's disk instead of answering a miss until the old
    segment is removed (found by the cluster run's disk tier schedule, issue #34)."""
    flags = {"disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB"}
    with (
        store_cluster(
            nodes=1,
            segment_size="4MiB",
            master_flags={**MASTER, "heartbeat_timeout_ms": 1000, "suspect_grace_ms": 60000},
            node_flags=flags,
            tmp=tmp_path / "cluster",
        ) as c,
        StoreClient(ClientConfig(master=c.master)) as client,
    ):
        keys = _put_and_offload(client, "p", 24)
        disk = tmp_path / "disk" / "objects"
        promoted = sorted(k for k in keys if (disk / files.file_name(k)).exists())[:3]
        assert promoted and [client.get(k) for k in promoted] == [_data(keys.index(k)) for k in promoted]
        c.nodes[0].kill()
        c.add_node("4MiB", **flags)
        segs = _wait(lambda: [s for s in client._rpc.call("status")["segments"] if s["suspect"]], "old segment suspect")
        assert len(segs) == 1 and len(client._rpc.call("status")["segments"]) == 2
        assert client.batch_exists(promoted) == [True] * len(promoted)
        assert [client.get(k) for k in promoted] == [_data(keys.index(k)) for k in promoted]
        assert len(client._rpc.call("status")["segments"]) == 2  # read while the old segment is still there


def test_offload_and_promote_are_published_as_kv_events(tmp_path):
    """KV events (master/events.py) over the disk tier: an offload is a removal from CPU plus a store on STORAGE,
    a promotion a store on CPU again; a remove of a disk-only object is a removal from STORAGE."""
    import msgspec
    import zmq

    from kvplugins.store.master.events import EventBatch

    flags = {"disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB"}
    with (
        store_cluster(
            nodes=1,
            segment_size="4MiB",
            master_flags={**MASTER, "events_port": 0},
            node_flags=flags,
            tmp=tmp_path / "cluster",
        ) as c,
        StoreClient(ClientConfig(master=c.master)) as client,
    ):
        keys = _put_and_offload(client, "e", 24)
        ctx = zmq.Context()
        replay = ctx.socket(zmq.DEALER)
        client_socket(replay, load_secret())  # the event sockets are CURVE servers
        replay.connect(client.master_call("info", [])["events_replay"])
        decode = msgspec.msgpack.Decoder(EventBatch).decode

        def events() -> list[tuple]:
            replay.send_multipart((b"", (0).to_bytes(8, "big", signed=True)))
            out = []
            while replay.poll(10000):
                _, _, seq, payload = replay.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) < 0:
                    return out
                out += [
                    (type(e).__name__, e.block_hashes[0].decode(), e.medium, e.reason) for e in decode(payload).events
                ]
            raise AssertionError("no end of replay")

        offloaded = {k for t, k, m, r in events() if (t, m, r) == ("BlockStored", "STORAGE", "offloaded")}
        assert len(offloaded) >= 10 and offloaded <= set(keys)
        assert {k for t, k, m, r in events() if (t, m, r) == ("BlockRemoved", "CPU", "offloaded")} == offloaded
        one = sorted(offloaded)[0]
        assert client.get(one) == _data(keys.index(one))  # promoted back to DRAM
        assert ("BlockStored", one, "CPU", "promoted") in events()
        disk_only = sorted(offloaded)[-1]
        if client._rpc.call("get", [disk_only])[0][0] == protocol.ON_DISK:  # still on disk only
            client.remove(disk_only)
            assert ("BlockRemoved", disk_only, "STORAGE", "removed") in events()
        replay.close(0)
        ctx.term()
