"""``kvplugins store --drain`` with real processes: a node's objects (in DRAM, and only on its disk) move to the
other nodes through the transfer core while a reader keeps reading every key; then the node unregisters and exits."""

import subprocess
import threading
import time

from helpers.cluster import store_cluster
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.embedded import CLI

OBJ = 32 << 10


def _data(i: int) -> bytes:
    return bytes([i % 251]) * (OBJ - 4) + i.to_bytes(4, "little")


class Reader(threading.Thread):
    """Reads every key in a loop until stopped; records any wrong answer."""

    def __init__(self, master: str, keys: list[str]):
        super().__init__(daemon=True)
        self.master, self.keys, self.errors, self.rounds = master, keys, [], 0
        self.stop = threading.Event()

    def run(self) -> None:
        with StoreClient(ClientConfig(master=self.master)) as client:
            while not self.stop.is_set():
                for i, v in enumerate(client.batch_get(self.keys)):
                    if v != _data(i):
                        self.errors.append((self.keys[i], repr(v)[:80]))
                self.rounds += 1


def _drain(master: str, segment: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        CLI + ["store", "--drain", "--master", master, "--segment", segment], capture_output=True, text=True, timeout=60
    )


def _segments(client) -> dict:
    return {s["name"]: s["objects"] for s in client._rpc.call("status")["segments"]}


def test_drain_moves_objects_while_reads_continue():
    with (
        store_cluster(nodes=2, segment_size="4MiB", node_flags={"transports": "tcp"}) as c,
        StoreClient(ClientConfig(master=c.master)) as client,
    ):
        keys = [f"d/{i}" for i in range(60)]
        assert client.batch_put(keys, [_data(i) for i in range(60)]) == [None] * 60
        leaving = c.nodes[0]
        moved = _segments(client)[leaving.address]
        assert moved > 0
        reader = Reader(c.master, keys)
        reader.start()
        time.sleep(0.3)
        done = _drain(c.master, leaving.address)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "drained" in done.stdout
        leaving.popen.wait(timeout=10)  # the node exits by itself
        assert leaving.popen.returncode == 0
        time.sleep(0.3)
        reader.stop.set()
        reader.join(timeout=20)
        assert reader.errors == [] and reader.rounds >= 2
        assert _segments(client) == {c.nodes[1].address: 60}
        assert client._rpc.call("status")["migrations"] == moved
        assert client.batch_get(keys) == [_data(i) for i in range(60)]
        client.put("d/after", b"x")  # the pool still takes puts


def test_drain_moves_disk_only_objects(tmp_path):
    master = {"high_watermark": 0.2, "low_watermark": 0.1, "lease_ttl_ms": 300}
    disk = {"disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB"}
    with (
        store_cluster(nodes=1, segment_size="2MiB", master_flags=master, node_flags=disk) as c,
        StoreClient(ClientConfig(master=c.master)) as client,
    ):
        keys = [f"k/{i}" for i in range(30)]
        for i, k in enumerate(keys):
            client.put(k, _data(i))
            time.sleep(0.01)
        t0 = time.monotonic()
        while client._rpc.call("status")["disk_objects"] < 15:
            assert time.monotonic() - t0 < 10, "no offloads"
            time.sleep(0.05)
        c.add_node("16MiB")  # room for everything below its high watermark
        leaving = c.nodes[0]
        done = _drain(c.master, leaving.address)
        assert done.returncode == 0, done.stdout + done.stderr
        leaving.popen.wait(timeout=10)
        status = client._rpc.call("status")
        assert [s["name"] for s in status["segments"]] == [c.nodes[1].address]
        assert status["migrations"] == 30 and status["disk_objects"] == 0
        assert client.batch_get(keys) == [_data(i) for i in range(30)]


def test_drain_of_an_unknown_segment_fails_clearly():
    from helpers.cluster import master_process

    with master_process() as m:
        done = _drain(m.address, "nope:1")
        assert done.returncode != 0 and "nope:1 is not the segment of a running `kvplugins store` node" in done.stderr
        done = subprocess.run(
            CLI + ["store", "--drain", "--master", m.address], capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0 and "--drain needs --segment NAME" in done.stderr


def test_drain_of_a_client_segment_moves_its_objects_and_the_client_goes_on():
    """A client contributing a segment runs the node's command link: `--drain` of its segment migrates the objects
    to a node, the segment leaves the pool, and the client keeps reading and writing without one."""
    with (
        store_cluster(nodes=1, segment_size="4MiB", node_flags={"transports": "tcp"}) as c,
        StoreClient(ClientConfig(master=c.master, segment_size="2MiB", preferred_segment="")) as owner,
    ):
        mine = owner.stats()["segment"]
        keys = [f"cd/{i}" for i in range(20)]
        from kvplugins.store.placement import PutConfig

        assert owner.batch_put(keys, [_data(i) for i in range(20)], PutConfig(preferred_segment=mine)) == [None] * 20
        assert _segments(owner)[mine] == 20
        done = _drain(c.master, mine)
        assert done.returncode == 0, done.stdout + done.stderr
        assert _segments(owner) == {c.nodes[0].address: 20}
        assert owner.batch_get(keys) == [_data(i) for i in range(20)]
        owner.put("cd/after", b"x")
        assert owner.get("cd/after") == b"x"


def test_a_client_whose_command_link_fails_to_start_leaves_no_segment(monkeypatch):
    import pytest
    from kvplugins.errors import StoreError
    from kvplugins.store.node.disk import worker

    def refuse(self):
        raise StoreError("refused for the test")

    monkeypatch.setattr(worker.NodeTier, "_register", refuse)  # this process only; the node is another process
    with store_cluster(nodes=1, segment_size="4MiB") as c, StoreClient(ClientConfig(master=c.master)) as probe:
        with pytest.raises(StoreError, match="refused for the test"):
            StoreClient(ClientConfig(master=c.master, segment_size="2MiB"))
        assert list(_segments(probe)) == [c.nodes[0].address]  # its segment was unregistered at once
