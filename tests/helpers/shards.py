"""A real sharded store on loopback for tests: etcd (helpers/etcd.py), ``kvplugins master --cluster --shard``
processes and ``kvplugins store --master shards://...`` nodes, each started on port 0 and waited for.

    with etcd_server() as e, sharded_store(e, shards=["a", "b", "c"], nodes=2) as s:
        StoreClient(ClientConfig(master=s.address))
        s.add_master("d"); s.masters["d"][0].kill()
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvplugins.store.cluster.membership import Membership
from tests.helpers.cluster import Proc, _env, _flags, _spawn, _start_node, _wait_file

WINDOW_MS = 4000  # move window of the test masters (the default is 30 s)


@dataclass
class ShardedStore:
    address: str  # shards://127.0.0.1:PORT/prefix
    etcd_url: str
    tmp: Path
    env: dict
    master_flags: dict
    masters: dict = field(default_factory=dict)  # shard id -> [Proc, ...] (an HA pair has two)
    nodes: list = field(default_factory=list)

    def add_master(self, shard: str, ha: bool = False, wait: bool = True) -> Proc:
        """Start a master of ``shard`` (with ``ha``: one more of its HA pair); with ``wait``, waits until it is a
        member (it joins once nodes handed it extents, or after the hand-over wait: master/shard.py)."""
        n = sum(len(v) for v in self.masters.values())
        port_file = self.tmp / f"master{n}.port"
        flags = {"cluster": self.address, "shard": shard, "shard_move_window_ms": WINDOW_MS, **self.master_flags}
        if ha:
            flags["etcd"] = self.etcd_url
        proc = _spawn(
            ["master", "--port", "0", "--port-file", str(port_file)] + _flags(flags),
            self.tmp / f"master{n}-{shard}.log",
            self.env,
        )
        proc.address = _wait_file(proc, port_file, f"kvplugins master --shard {shard}")
        self.masters.setdefault(shard, []).append(proc)
        if wait:
            self.wait_for(lambda st: shard in st.members and not st.unswept(), f"shard {shard} to join")
        return proc

    def add_node(self, segment_size="24MiB", **flags) -> Proc:
        node = _start_node(
            self.address, segment_size, self.tmp, len(self.nodes), self.env, {"heartbeat_interval_ms": 200, **flags}
        )
        self.nodes.append(node)
        return node

    def state(self):
        return Membership(self.address).read()

    def wait_for(self, check, what: str, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.state()
            if check(st):
                return st
            time.sleep(0.1)
        logs = "\n".join(p.log_tail(1500) for ps in self.masters.values() for p in ps)
        raise AssertionError(f"timed out waiting for {what}; membership {self.state()}\n{logs}")

    def wait_segments(self, per_shard: int, timeout_s: float = 30.0) -> dict:
        """Wait until every shard's master has ``per_shard`` segments registered; shard id -> status."""
        from kvplugins.store.client.connect import master_client

        deadline = time.monotonic() + timeout_s
        while True:
            st, out = self.state(), {}
            for sid, addr in st.members.items():
                rpc = master_client(addr, 2000)
                try:
                    out[sid] = rpc.call("status")
                except Exception:  # noqa: BLE001 - not up yet
                    out[sid] = {"segments": []}
                finally:
                    rpc.close()
            if all(len(s["segments"]) == per_shard for s in out.values()):
                return out
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"segments per shard: { {k: len(v['segments']) for k, v in out.items()} }, want {per_shard}"
                )
            time.sleep(0.1)

    def kill_all(self) -> None:
        for proc in self.nodes + [p for ps in self.masters.values() for p in ps]:
            proc.kill()


def leads(address: str) -> bool:
    """Whether the master at ``address`` serves (an HA standby refuses ops)."""
    from kvplugins.errors import StoreError
    from kvplugins.store.client.rpc import RawRpcClient

    rpc = RawRpcClient(address, 1000)
    try:
        rpc.call("info")
        return True
    except StoreError:
        return False
    finally:
        rpc.close()


@contextlib.contextmanager
def sharded_store(
    etcd,
    shards=("a", "b", "c"),
    nodes: int = 2,
    segment_size="24MiB",
    ha=(),
    master_flags=None,
    node_flags=None,
    prefix: str = "/kvp-test",
):
    """Masters for ``shards`` (shard ids in ``ha`` as HA pairs), then ``nodes`` nodes. Yields ShardedStore."""
    with tempfile.TemporaryDirectory(prefix="kvp-shards-") as d:
        tmp = Path(d)
        store = ShardedStore(
            "shards://" + etcd.url.removeprefix("http://") + prefix,
            etcd.url,
            tmp,
            _env(tmp),
            {"lease_ttl_ms": 1000, "put_timeout_ms": 3000, "heartbeat_timeout_ms": 1500, **(master_flags or {})},
        )
        try:
            for sid in shards:  # a master joins once nodes handed it extents (master/shard.py): nodes next
                store.add_master(sid, ha=sid in ha, wait=False)
                if sid in ha:
                    store.add_master(sid, ha=True, wait=False)
            for _ in range(nodes):
                store.add_node(segment_size, **(node_flags or {}))
            store.wait_for(lambda st: set(st.members) == set(shards) and not st.unswept(), f"shards {shards} to join")
            yield store
        finally:
            store.kill_all()
