"""Hash-sharded masters (kvplugins/store/cluster, issue #18 part 3) against real processes: etcd, `kvplugins master
--cluster --shard` processes (one shard as an HA pair where asked) and `kvplugins store` nodes on loopback."""

from __future__ import annotations

import collections
import hashlib
import random
import subprocess
import sys
import signal
import threading
import time

import pytest

from kvplugins.errors import StoreError
from kvplugins.store.wire import protocol
from kvplugins.store.client import StoreClient
from kvplugins.store.config import ClientConfig
from kvplugins.store.client.rpc import RawRpcClient
from kvplugins.store.cluster.membership import Membership
from kvplugins.store.node.extents import assign
from kvplugins.store.cluster.ring import Ring
from kvplugins.store.master.shard import MAX_VIEW_AGE_S
from tests.helpers.etcd import etcd_server
from tests.helpers.shards import WINDOW_MS, leads, sharded_store


def value(key: str, n: int = 2048) -> bytes:
    """The bytes every put of ``key`` stores (so a read can tell right bytes from wrong ones)."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (n // len(seed) + 1))[:n]


@pytest.fixture(scope="module")
def etcd():
    with etcd_server() as e:
        yield e


def test_ring_spreads_100k_keys_within_1_2x_and_a_new_shard_moves_only_its_keys():
    keys = [f"model/tp0/{i:08d}" for i in range(100_000)]
    three, four = Ring(["a", "b", "c"]), Ring(["a", "b", "c", "d"])
    owners3 = three.owners(keys)
    counts = {m: owners3.count(m) for m in "abc"}
    assert max(counts.values()) <= 1.2 * len(keys) / 3, counts
    assert abs(sum(three.shares().values()) - 1) < 1e-9
    owners4 = four.owners(keys)
    moved = [(o3, o4) for o3, o4 in zip(owners3, owners4) if o3 != o4]
    assert moved and all(o4 == "d" for _, o4 in moved)  # only the new shard gains keys
    assert 0.15 < len(moved) / len(keys) < 0.35
    assert Ring(["c", "b", "a"]).owners(keys[:1000]) == owners3[:1000]  # order of members does not matter
    assert [three.owner(k) for k in keys[:500]] == owners3[:500]


def test_extent_assignment_is_even_and_moves_the_fewest():
    first = assign([None] * 12, ["a", "b", "c"], "node0")
    assert sorted(first.count(m) for m in "abc") == [4, 4, 4]
    grown = assign(first, ["a", "b", "c", "d"], "node0")
    assert sorted(grown.count(m) for m in "abcd") == [3, 3, 3, 3]
    assert sum(x != y for x, y in zip(first, grown)) == 3  # exactly the 3 extents d gets moved
    shrunk = assign(grown, ["a", "b", "c"], "node0")
    assert sum(x != y for x, y in zip(grown, shrunk)) == 3  # only d's extents move back
    odd = [assign([None] * 4, ["a", "b", "c"], f"node{i}") for i in range(30)]
    extra = {m: sum(a.count(m) == 2 for a in odd) for m in "abc"}  # the 4th extent goes to varying shards
    assert all(v > 0 for v in extra.values()), extra
    assert assign([None] * 3, [], "n") == [None] * 3


def test_membership_changes_wait_for_the_sweep_and_refuse_unknown_shards(etcd):
    members = Membership(f"shards://{etcd.url.removeprefix('http://')}/kvp-unit-{time.monotonic_ns()}")
    st = members.join("a", "127.0.0.1:1", window_ms=60_000)
    assert (st.epoch, st.previous, st.moving()) == (1, None, False)
    members.report("a", 1, 1)
    st = members.join("b", "127.0.0.1:2", window_ms=60_000)
    assert st.epoch == 2 and st.previous == {"a": "127.0.0.1:1"} and st.moving()
    with pytest.raises(StoreError, match="still being swept by a, b"):
        members.join("c", "127.0.0.1:3", window_ms=0)
    assert members.join("b", "127.0.0.1:2", 0).epoch == 2  # same address: nothing changes
    assert members.join("b", "127.0.0.1:9", 0).members["b"] == "127.0.0.1:9"  # new address, same keys
    with pytest.raises(StoreError, match="'zz' is not a member"):
        members.remove("zz", 0)
    members.report("a", 2, 1)
    members.report("b", 2, 1)
    st = members.remove("b", window_ms=0)
    assert st.epoch == 3 and set(st.members) == {"a"} and st.previous == {"a": "127.0.0.1:1", "b": "127.0.0.1:9"}
    assert members.read().moving()  # window 0 is over, but a has not reported settled for epoch 3
    members.report("a", 3, 3)
    assert not members.read().moving()


def test_an_announced_master_owns_no_key_until_it_joins(etcd):
    """Announcing (cluster/membership.py): the first master of an empty ring joins at once; a later one is only
    joining (nodes give it extents: extent_holders) until it joins; a joining one is removed without a move."""
    members = Membership(f"shards://{etcd.url.removeprefix('http://')}/kvp-unit-{time.monotonic_ns()}")
    st = members.announce("a", "127.0.0.1:1", window_ms=0)
    assert (st.epoch, st.members, st.joining) == (1, {"a": "127.0.0.1:1"}, {})
    members.report("a", 1, 1)
    st = members.announce("b", "127.0.0.1:2", window_ms=0)
    read = members.read()
    assert read.epoch == 1 and set(read.members) == {"a"} and read.ring.owners(["k"]) == ["a"]
    assert read.joining["b"].address == "127.0.0.1:2" and read.extent_holders == {
        "a": "127.0.0.1:1",
        "b": "127.0.0.1:2",
    }
    since = read.joining["b"].since
    assert members.announce("b", "127.0.0.1:3", 0).joining["b"].since == since  # a restart keeps its wait
    st = members.join("b", "127.0.0.1:3", window_ms=0)
    assert st.epoch == 2 and set(st.members) == {"a", "b"} and st.joining == {} and members.read().joining == {}
    members.announce("c", "127.0.0.1:4", 0)
    st = members.remove("c", 0)
    assert st.epoch == 2 and "c" not in st.extent_holders and members.read().joining == {}


@pytest.fixture(scope="module")
def store(etcd):
    with sharded_store(etcd, shards=("a", "b", "c"), nodes=2, prefix="/kvp-three") as s:
        s.wait_segments(8)  # 2 nodes x 12 extents over 3 shards
        yield s


def test_three_shards_spread_100k_keys_and_serve_every_one(store):
    keys = [f"spread/{i}" for i in range(100_000)]
    before = {sid: st["objects"] for sid, st in store.wait_segments(8).items()}  # other tests' objects
    with StoreClient(ClientConfig(master=store.address)) as c:
        for at in range(0, len(keys), 2_000):  # each put's writes well inside the grant's 3 s put_timeout_ms, also
            chunk = keys[at : at + 2_000]  # while the QEMU guest test loads CI (10,000-key puts ran 18x slower there)
            errs = c.batch_put(chunk, [value(k, 64) for k in chunk])
            assert errs == [None] * len(chunk), [e for e in errs if e][:3]
        for at in range(0, len(keys), 5_000):  # each batch well inside the shards' 1 s read lease, also on a
            chunk = keys[at : at + 5_000]  # slow machine (25,000-key batches outlived it under load)
            assert c.batch_get(chunk) == [value(k, 64) for k in chunk]
        assert c.batch_exists(keys[:10] + ["spread/none"]) == [True] * 10 + [False]
        assert c.batch_exists_prefix(keys[:5] + ["spread/none"] + keys[5:8]) == 5
        c.remove(keys[0])
        assert c.batch_exists(keys[:2]) == [False, True]
        objects = {sid: st["objects"] - before.get(sid, 0) for sid, st in store.wait_segments(8).items()}
        for at in range(1, len(keys), 10_000):  # the pool is shared: leave its space to the other tests
            c.batch_remove(keys[at : at + 10_000])
    share = (len(keys) - 1) / 3
    assert sum(objects.values()) == len(keys) - 1
    assert max(objects.values()) <= 1.2 * share and min(objects.values()) >= 0.8 * share, objects


def test_a_master_refuses_a_put_of_a_key_another_shard_owns(store):
    st = store.state()
    key = next(f"wrong/{i}" for i in range(100) if st.ring.owner(f"wrong/{i}") != "a")
    rpc = RawRpcClient(st.members["a"], 2000)
    try:
        [(code, why)] = rpc.call("put_start", [[key, 64]])
    finally:
        rpc.close()
    assert code == protocol.WRONG_SHARD and f"owned by shard {st.ring.owner(key)}" in why


def test_status_shows_the_shards(store):
    out = subprocess.run(
        [sys.executable, "-m", "kvplugins.cli", "status", "--master", store.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for sid in "abc":
        assert f"│ {sid} " in out.stdout
    assert "epoch" in out.stdout and "3 shards" in out.stdout


def _workload(client, stop: threading.Event, acked: dict, wrong: list, counts: dict) -> None:
    """Put new keys and read back random acknowledged ones until ``stop``; record wrong bytes and failed puts."""
    rng, n = random.Random(7), 0
    while not stop.wait(0.05):
        keys = [f"churn/{n + i}" for i in range(50)]
        n += 50
        for k, err in zip(keys, client.batch_put(keys, [value(k) for k in keys])):
            if err is None:
                acked[k] = True
            else:
                counts.setdefault("put_errors", []).append(f"{k}: {err}")
        sample = rng.sample(sorted(acked), min(200, len(acked)))
        for k, got in zip(sample, client.batch_get(sample)):
            if isinstance(got, bytes):
                counts["hits"] += 1
                if got != value(k):
                    wrong.append(k)
            else:
                counts["misses"] += 1


def _read_back(client, ring, acked: dict, shard: str, n: int = 200) -> tuple[list, list]:
    """Up to ``n`` acknowledged keys ``shard`` owns in ``ring``, and what a get of them answers now."""
    keys = [k for k in list(acked) if ring.owner(k) == shard][-n:]
    return keys, client.batch_get(keys)


def test_adding_and_removing_a_master_mid_workload_never_returns_wrong_bytes(store):
    acked, wrong, counts, stop = {}, [], {"hits": 0, "misses": 0}, threading.Event()
    with StoreClient(ClientConfig(master=store.address)) as c:
        worker = threading.Thread(target=_workload, args=(c, stop, acked, wrong, counts))
        worker.start()
        try:
            time.sleep(1.0)
            before = dict(acked)
            t0 = time.monotonic()
            store.add_master("d")
            print(f"d joined in {time.monotonic() - t0:.1f} s")
            ring = store.state().ring  # read once: per key, the reads outlasted the move window
            moved = [k for k in before if ring.owner(k) == "d"]
            during = c.batch_get(moved)  # within the window: read from their previous shard
            dual_hits = sum(isinstance(g, bytes) for g in during)
            store.wait_segments(6)  # every node moved 3 of its 12 extents to d
            store.wait_for(lambda st: not st.moving(), "the move to d to settle")
            print(f"settled at {time.monotonic() - t0:.1f} s")
            time.sleep(1.0)
            on_d = [k for k, g in zip(*_read_back(c, store.state().ring, acked, "d")) if isinstance(g, bytes)]
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kvplugins.cli",
                    "shard",
                    "remove",
                    "d",
                    "--master",
                    store.address,
                    "--window-ms",
                    str(WINDOW_MS),
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            time.sleep(1.5)  # the nodes have read the new membership (0.5 s polls); the window runs 4 s
            leaving = c.batch_get(on_d)  # within the window: read from d (before, nodes had taken its extents)
            store.wait_for(lambda st: "d" not in st.members and not st.moving(), "the removal of d to settle")
            print(f"removed at {time.monotonic() - t0:.1f} s, {len(acked)} keys")
            time.sleep(1.0)
        finally:
            stop.set()
            worker.join(timeout=60)
        t_final = time.monotonic()
        final = c.batch_get(sorted(acked))
        print(f"final read {time.monotonic() - t_final:.2f} s")
    assert not wrong, f"wrong bytes for {wrong[:5]}"
    # d owned no key before it held DRAM: no put failed (before, puts of d's keys were StoreFull "no segment is
    # registered" for the nodes' hand-over wait, lease TTL + put timeout: issue #34)
    full = [e for e in counts.get("put_errors", []) if "StoreFull" in e or "no segment" in e or "no space" in e]
    assert not full, (len(full), full[:3], len(counts.get("put_errors", [])))
    # a put the shards' views disagree on is resent until they agree (before: 54 of ~14,000 failed, five resends
    # in well under the masters' 0.5 s membership poll)
    wrong_shard = [e for e in counts.get("put_errors", []) if "owned by shard" in e or "disagree" in e]
    assert not wrong_shard, (len(wrong_shard), wrong_shard[:3], len(counts.get("put_errors", [])))
    assert all(g == value(k) for k, g in zip(sorted(acked), final) if isinstance(g, bytes))
    assert dual_hits > 0.5 * len(moved), (dual_hits, len(moved))
    assert on_d and sum(isinstance(g, bytes) for g in leaving) > 0.5 * len(on_d), (len(on_d), leaving[:3])
    why = collections.Counter(type(g).__name__ + ": " + str(g)[:80] for g in final if not isinstance(g, bytes))
    assert counts["hits"] > counts["misses"], counts
    assert sum(isinstance(g, bytes) for g in final) > 0.3 * len(acked), why.most_common(5)
    store.masters.pop("d")[0].kill()


def test_sigkill_of_one_ha_shard_leaves_the_others_serving(etcd, monkeypatch):
    """A SIGKILL of an HA shard's leader: the other shards' keys are served throughout, the shard's keys again
    once its standby leads. Gets go through the native fan-out with the HA shard's leader connection in it
    (native.shard_call, counted through a wrapper: the real call runs) before the kill and after the fail-over."""
    from kvplugins import native
    from kvplugins.store.client import router

    calls = []
    real = native.shard_call
    monkeypatch.setattr(router.native, "shard_call", lambda *a: (calls.append(1), real(*a))[1])
    with sharded_store(etcd, shards=("a", "b", "c"), ha=("b",), nodes=2, prefix="/kvp-ha") as s:
        s.wait_segments(8)
        st = s.wait_for(lambda st: not st.moving(), "the last join's move to end")  # moves route in Python
        keys = [f"ha/{i}" for i in range(600)]
        by = {sid: [k for k in keys if st.ring.owner(k) == sid] for sid in "abc"}
        with StoreClient(ClientConfig(master=s.address, rpc_timeout_ms=6000)) as c:
            assert c.batch_put(keys, [value(k, 512) for k in keys]) == [None] * len(keys)
            calls.clear()
            assert c.batch_get(keys) == [value(k, 512) for k in keys] and len(calls) == 1
            leader = next(p for p in s.masters["b"] if leads(p.address))
            leader.kill()
            t0, others_ok = time.monotonic(), []
            while time.monotonic() - t0 < 30:
                others_ok.append(c.batch_get(by["a"] + by["c"]) == [value(k, 512) for k in by["a"] + by["c"]])
                if all(isinstance(g, bytes) for g in c.batch_get(by["b"])):
                    break
            routed_around = time.monotonic() - t0
            print(f"b's keys served again {routed_around:.2f} s after its leader's SIGKILL")
            assert all(others_ok), others_ok
            assert c.batch_get(by["b"]) == [value(k, 512) for k in by["b"]], "b's standby did not take over"
            n = len(calls)
            assert c.batch_get(keys) == [value(k, 512) for k in keys] and len(calls) == n + 1
    assert routed_around < 15


def test_a_node_stops_within_one_unregister_timeout_when_its_masters_hang(etcd):
    """SIGTERM of a sharded node whose masters are frozen (SIGSTOP): it releases its 12 extents at once, so it
    exits 0 after about one unregister timeout (1 s), not one per extent (found by the cluster runs: 12 serial
    unregisters outlasted a 15 s stop and the node was SIGKILLed, issue #34)."""
    with sharded_store(etcd, shards=("a", "b"), nodes=1, prefix="/kvp-stop") as s:
        s.wait_segments(6)
        masters = [p for ps in s.masters.values() for p in ps]
        for p in masters:
            p.popen.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            s.nodes[0].popen.send_signal(signal.SIGTERM)
            rc = s.nodes[0].popen.wait(timeout=30)
            took = time.monotonic() - t0
        finally:
            for p in masters:
                p.popen.send_signal(signal.SIGCONT)
    assert rc == 0, s.nodes[0].log_tail()
    assert took < 6.0, f"the node took {took:.1f} s to stop"


def test_a_master_that_cannot_read_the_membership_refuses_puts_until_it_can():
    """A master whose view of the ring may be stale (etcd SIGSTOPped: its reads hang) must not acknowledge puts:
    a ring change it has not seen would leave them on a shard readers no longer ask (issue #34: a put acked 1.5 s
    after a move began was lost in a cluster run). Past MAX_VIEW_AGE_S every put answers WRONG_SHARD naming the
    age; once etcd answers again, puts are accepted within a few polls. Gets need no ring and keep working."""
    with etcd_server() as e, sharded_store(e, shards=("a",), nodes=1, prefix="/kvp-stale") as s:
        s.wait_segments(12)  # 1 node x 12 extents
        addr = s.state().members["a"]
        with StoreClient(ClientConfig(master=s.address)) as c:
            c.put("stale/before", value("stale/before"))
        rpc = RawRpcClient(addr, 3000)
        try:
            [(code, _)] = rpc.call("put_start", [["stale/0", 64]])
            assert code == protocol.OK
            e.popen.send_signal(signal.SIGSTOP)
            try:
                time.sleep(MAX_VIEW_AGE_S + 1.5)
                [(code, why)] = rpc.call("put_start", [["stale/1", 64]])
                assert code == protocol.WRONG_SHARD and "last read the membership" in why, (code, why)
                assert rpc.call("exists", ["stale/before"]) == [True]
            finally:
                e.popen.send_signal(signal.SIGCONT)
            deadline, code = time.monotonic() + 10, None
            while code != protocol.OK and time.monotonic() < deadline:
                time.sleep(0.2)
                [(code, why)] = rpc.call("put_start", [["stale/2", 64]])
            assert code == protocol.OK, why
        finally:
            rpc.close()


@pytest.mark.parametrize("op", ["exists", "get"])
def test_a_read_is_one_native_fan_out_and_a_dead_shard_costs_only_its_keys(etcd, monkeypatch, op):
    """exists and get over plain shard masters run as one native call per batch (native.shard_exists /
    shard_call, counted through a wrapper: the real call runs), each key's answer (and a get's bytes) right; a
    frozen shard master (SIGSTOP) costs its keys (misses after the RPC timeout, not a hang), the others answer
    right, and a SIGKILLed one the same at once."""
    from kvplugins import native
    from kvplugins.store.client import router

    calls = []
    name = "shard_exists" if op == "exists" else "shard_call"
    real = getattr(native, name)
    monkeypatch.setattr(router.native, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    with sharded_store(etcd, shards=("a", "b", "c"), nodes=1, prefix="/kvp-fan") as s:
        s.wait_segments(4)
        st = s.wait_for(lambda st: not st.moving(), "the last join's move to end")  # moves route in Python
        keys = [f"fan/{i}" for i in range(300)]
        stored = keys[::2]
        with StoreClient(ClientConfig(master=s.address, rpc_timeout_ms=1500)) as c:

            def found() -> list[bool]:
                if op == "exists":
                    return c.batch_exists(keys)
                got = c.batch_get(keys)
                assert all(v == value(k, 64) for k, v in zip(keys, got) if isinstance(v, bytes))
                return [isinstance(v, bytes) for v in got]

            assert c.batch_put(stored, [value(k, 64) for k in stored]) == [None] * len(stored)
            calls.clear()
            assert found() == [k in set(stored) for k in keys] and len(calls) == 1
            if op == "exists":
                assert c.batch_exists_prefix(keys) == 1 and len(calls) == 2
            b = s.masters["b"][0]
            b.popen.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                got = found()
                assert time.monotonic() - t0 < 5
            finally:
                b.popen.send_signal(signal.SIGCONT)
            want = [k in set(stored) and st.ring.owner(k) != "b" for k in keys]
            assert got == want and any(st.ring.owner(k) == "b" for k in stored)
            b.kill()
            n = len(calls)
            assert found() == want and len(calls) == n + 1
