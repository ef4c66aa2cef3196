"""Master HA on a real etcd (tests/helpers/etcd.py): election among two `kvplugins master --etcd` processes, a
SIGKILLed leader replaced mid-workload with no acknowledged object lost (read back byte-exact), a restarted
single master recovering every committed object's placement. Real processes on loopback, port 0."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.cluster import _env, _spawn, _start_node, _wait_file, store_cluster
from helpers.etcd import etcd_server
from kvplugins.errors import MasterUnreachable, StoreError
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.config import MasterConfig
from kvplugins.store.cluster.etcd import Etcd, put_op
from kvplugins.store.client.follower import leader_info
from kvplugins.store.master.ha import journal as ha_journal
from kvplugins.store.master.ha.journal import EtcdJournal, decode_object
from kvplugins.store.master.ha.leader import LeaderGuard
from kvplugins.store.wire.protocol import NOT_FOUND, OK, PENDING, STORE_FULL
from kvplugins.store.client.rpc import RawRpcClient
from kvplugins.store.client.connect import master_client

pytestmark = pytest.mark.timeout(120)


def _master(etcd_url: str, prefix: str, tmp: Path, i: int):
    port_file = tmp / f"master{i}.port"
    proc = _spawn(
        ["master", "--port", "0", "--port-file", str(port_file), "--etcd", etcd_url, "--etcd-prefix", prefix],
        tmp / f"master{i}.log",
        _env(tmp),
    )
    proc.address = _wait_file(proc, port_file, f"HA master #{i}")
    return proc


@dataclass
class _Ha:
    """A real etcd plus the processes started on it (all killed when the test ends)."""

    etcd: object
    prefix: str
    tmp: Path
    procs: list = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.etcd.endpoint + self.prefix

    def master(self, i: int):
        self.procs.append(_master(self.etcd.url, self.prefix, self.tmp, i))
        return self.procs[-1]

    def node(self, size: str = "16MiB"):
        self.procs.append(_start_node(self.address, size, self.tmp, 0, _env(self.tmp), {}))
        return self.procs[-1]


@contextlib.contextmanager
def _ha(tmp: Path, prefix: str, masters: int = 2):
    with etcd_server() as etcd:
        ha = _Ha(etcd, prefix, tmp)
        try:
            for i in range(masters):
                ha.master(i)
            yield ha
        finally:
            for proc in ha.procs:
                proc.kill()


def _wait_leader(address: str, timeout_s: float = 15.0) -> dict:
    """The leader's {"raw", "zmq"} once it answers ops (recovery done)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = leader_info(address)
        if info is not None:
            try:
                RawRpcClient(info["raw"], 1000).call("info")
                return info
            except StoreError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"no leader answered within {timeout_s} s")


def _blob(rng: random.Random, i: int) -> bytes:
    return i.to_bytes(4, "little") + rng.randbytes(rng.randrange(1, 8192))


@pytest.fixture
def tmp():
    with tempfile.TemporaryDirectory(prefix="kvp-ha-") as d:
        yield Path(d)


def test_leader_killed_mid_workload_loses_no_acknowledged_object(tmp, monkeypatch):
    """Puts and gets go on across a SIGKILL of the leader; no acknowledged object is lost and no read returns
    wrong bytes. Puts and get_into take the native one-call path on the HA master too (native.put_many /
    get_many through LeaderClient.held, counted through wrappers: the real calls run), before and after the
    fail-over (a 64 MiB segment: the pool offers slabs)."""
    import numpy as np

    from kvplugins import native
    from kvplugins.store.client import store_client

    calls: dict[str, list[bool]] = {"put_many": [], "get_many": []}
    for name in calls:
        real = getattr(native, name)
        wrapped = lambda *a, real=real, name=name: (calls[name].append(killed.is_set()), real(*a))[1]  # noqa: E731
        monkeypatch.setattr(store_client.native, name, wrapped)
    rng = random.Random(6)
    with _ha(tmp, "/kvp/failover") as ha:
        address, masters = ha.address, list(ha.procs)
        leader = _wait_leader(address)
        old = next(m for m in masters if m.address == leader["raw"])
        standby = next(m for m in masters if m is not old)
        with pytest.raises(StoreError, match=f"not leader; the leader is {leader['raw']}"):
            RawRpcClient(standby.address, 2000).call("info")
        ha.node("64MiB")
        client = StoreClient(ClientConfig(master=address, rpc_timeout_ms=10000))
        buf = np.zeros(16384, dtype=np.uint8)
        client.register_buffer(buf)
        acked, failed, killed = {}, [], threading.Event()
        delay = rng.random() / 50  # kill 0-20 ms into a batch
        killer = threading.Thread(target=lambda: (time.sleep(delay), old.kill(), killed.set()))
        after_kill, reads_after_kill, i = 0, 0, 0
        deadline = time.monotonic() + 40
        while after_kill < 60 and time.monotonic() < deadline:
            keys = [f"k{i + j}" for j in range(3)]
            datas = [_blob(rng, i + j) for j in range(3)]
            i += 3
            for key, data, err in zip(keys, datas, client.batch_put(keys, datas)):
                if err is None:
                    acked[key] = data
                    after_kill += killed.is_set()
                else:
                    failed.append((key, err))
            if acked:  # reads go on too, and never return wrong bytes
                key = rng.choice(list(acked))
                value = client.batch_get([key])[0]
                assert value == acked[key] or isinstance(value, StoreError), key
                reads_after_kill += killed.is_set() and value == acked[key]
                n = len(acked[key])
                try:
                    client.get_into(key, [(buf.ctypes.data, n)])
                except StoreError:
                    pass
                else:
                    assert buf[:n].tobytes() == acked[key], key
            if len(acked) >= 120 and not killer.is_alive() and not killed.is_set():
                killer.start()
        assert killer.ident is not None, f"only {len(acked)} puts acknowledged before the deadline: {failed[:3]}"
        killer.join()
        assert killed.is_set() and not old.alive()
        assert after_kill >= 60, f"only {after_kill} puts acknowledged after the kill; failures {failed[-3:]}"
        assert reads_after_kill >= 10
        for name, after in calls.items():
            assert False in after and True in after, f"no native {name} before or after the kill: {len(after)}"
        assert len(failed) <= 6, f"{len(failed)} puts failed across one fail-over: {failed[:3]}"
        assert _wait_leader(address)["raw"] == standby.address
        got = client.batch_get(list(acked))
        lost = [k for k, v in zip(acked, got) if v != acked[k]]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged objects lost or wrong, e.g. {lost[:3]}"
        with StoreClient(ClientConfig(master=f"{old.address},{standby.address}")) as by_list:
            key = next(iter(acked))
            assert by_list.get(key) == acked[key]  # a comma list finds the surviving leader
        client.close()


def test_restarted_single_master_recovers_every_committed_object(tmp):
    rng = random.Random(7)
    with _ha(tmp, "/kvp/restart", masters=1) as ha:
        address = ha.address
        _wait_leader(address)
        ha.node()
        client = StoreClient(ClientConfig(master=address, rpc_timeout_ms=10000))
        data = {f"obj{i}": _blob(rng, i) for i in range(200)}
        assert client.batch_put(list(data), list(data.values())) == [None] * 200
        client.remove("obj0")
        del data["obj0"]
        ha.procs[0].kill()
        ha.master(1)
        _wait_leader(address)
        status = master_client(address, 5000).call("status")
        assert status["objects"] == 199 and len(status["segments"]) == 1
        got = client.batch_get(list(data))
        assert [k for k, v in zip(data, got) if v != data[k]] == []
        assert not client.exists("obj0")
        client.put("after-restart", b"x" * 100)  # the recovered allocator places new puts
        assert client.batch_get(list(data)[:20]) == list(data.values())[:20]
        assert client.get("after-restart") == b"x" * 100
        client.close()


def test_etcd_outage_stops_service_then_a_leader_serves_again(tmp):
    """etcd down for 3 s (longer than the leader lease): the leader steps down (nothing is served without a
    lease), the masters survive, and once etcd is back a leader recovers and serves every object."""
    with _ha(tmp, "/kvp/outage") as ha:
        leader = _wait_leader(ha.address)["raw"]
        ha.node()
        with StoreClient(ClientConfig(master=ha.address, rpc_timeout_ms=15000)) as client:
            data = {f"o{i}": bytes([i]) * (100 + i) for i in range(50)}
            assert client.batch_put(list(data), list(data.values())) == [None] * 50
            ha.etcd.stop()
            during: list = []  # a put whose etcd writes fail at first: its put_start (a pending put is
            # journaled, issue #30 item 10) or its commit; it may fail (not acknowledged) but never raise elsewhere

            def write_during():
                try:
                    during.append(client.batch_put(["during"], [b"d" * 64])[0])
                except StoreError as e:
                    during.append(e)

            writer = threading.Thread(target=write_during)
            writer.start()
            time.sleep(3.0)
            with pytest.raises(StoreError, match="not leader"):  # its lease could not be refreshed
                RawRpcClient(leader, 2000).call("info")
            ha.etcd.start()
            client.put("after", b"a" * 64)  # retried until a leader serves again
            writer.join()
            assert client.batch_get(list(data)) == list(data.values())
            assert client.get("after") == b"a" * 64
            if during[0] is None:  # acknowledged, so it must be there
                assert client.get("during") == b"d" * 64
        assert all(p.alive() for p in ha.procs)


def test_stopped_leader_hands_over_at_once(tmp):
    with _ha(tmp, "/kvp/handover") as ha:
        first = _wait_leader(ha.address)["raw"]
        old = next(m for m in ha.procs if m.address == first)
        old.kill(signal.SIGTERM)
        assert old.popen.returncode == 0
        assert (leader_info(ha.address) or {}).get("raw") != first  # its lease was revoked on the way out
        assert _wait_leader(ha.address)["raw"] == next(m for m in ha.procs if m is not old).address


def test_put_start_is_not_sent_twice_to_a_living_leader(tmp, monkeypatch):
    """A comma list of one real master: when the connection fails right after a request was applied, a
    read-only op is retried, but put_start is not re-sent to that same leader (it would answer 'exists')."""
    real, failing = RawRpcClient.call, {"exists", "put_start"}

    def call_then_fail(self, op, *args, **kwargs):
        out = real(self, op, *args, **kwargs)
        if op in failing:
            failing.discard(op)
            self.close()
            raise MasterUnreachable(self.address, 1, f"{op}: connection reset (injected)")
        return out

    with store_cluster(nodes=1, tmp=tmp) as c:
        client = master_client(f"{c.master},{c.master}", 3000)
        monkeypatch.setattr(RawRpcClient, "call", call_then_fail)
        assert client.call("exists", ["k"]) == [False]  # retried once, then answered
        with pytest.raises(MasterUnreachable, match="put_start: the connection to leader .* not sent again"):
            client.call("put_start", [["k", 64]])
        assert client.call("put_start", [["k", 64]])[0][0] == PENDING  # the first one was applied
        client.close()


def test_master_without_etcd_fails_with_a_clear_error(tmp):
    proc = _spawn(["master", "--port", "0", "--etcd", "http://127.0.0.1:1"], tmp / "m.log", {**os.environ})
    assert proc.popen.wait(timeout=30) != 0
    assert "etcd http://127.0.0.1:1" in proc.log_tail()


def test_a_leader_lookup_through_unanswering_etcd_members_costs_one_rpc_timeout():
    """Three etcd members that accept connections and never answer (listening sockets nobody reads: an isolated
    or frozen cluster): a client's leader lookup ends within its rpc_timeout_ms with MasterUnreachable, not
    after one etcd timeout per member (3 s here)."""
    import socket

    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    try:
        members = ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in socks)
        client = master_client(f"etcd://{members}", 1000)
        t0 = time.monotonic()
        with pytest.raises(MasterUnreachable, match="did not answer within 1000 ms"):
            client.call("info")
        took = time.monotonic() - t0
        client.close()
    finally:
        for s in socks:
            s.close()
    assert 0.9 <= took < 1.6, took


class _Lease:
    """An elector stand-in for in-process guards: leadership is set by the test (the etcd key is real)."""

    def __init__(self, etcd, key: str, value: bytes):
        self.value, self.leading, self.etcd, self.key = value, True, etcd, key

    def is_leader(self) -> bool:
        return self.leading

    def lost(self, why: str) -> None:
        self.leading = False


def _wire(seg_id: str, size: int) -> dict:
    return {"v": 1, "segment_id": seg_id, "host_id": "h", "transports": {}, "regions": [[1, size, None]]}


def test_journal_batches_are_fenced_and_recovery_rebuilds_placement():
    """In process, real etcd (behind a dead first member): 300 objects (3 transactions per op) with checksums
    and hard pins survive into a second guard; a deposed leader's write is refused; recovered allocators hand
    out no used byte twice."""
    with etcd_server() as server:
        etcd = Etcd(f"http://127.0.0.1:1,{server.url}")  # a member that is down: requests go to the next
        a, b = EtcdJournal(etcd, "/kvp/unit"), EtcdJournal(etcd, "/kvp/unit")
        assert etcd.create(a.leader_key, b"A", etcd.lease(10))
        first = LeaderGuard(MasterConfig(), a, _Lease(etcd, a.leader_key, b"A"))
        segs = [
            n
            for [(c, n)] in (
                first.handle("register_segment", [[_wire(s, 1 << 20), 1, 1 << 20]], {}) for s in ("s1", "s2")
            )
            if c == OK
        ]
        keys = [f"o{i}" for i in range(300)]
        placed = first.handle("put_start", [[k, 100 + i] for i, k in enumerate(keys)], {"replicas": 2, "pin": 2})
        assert all(code == OK for code, _ in placed)
        assert first.handle("put_commit", keys, {"xxh3": list(range(300))}) == [[OK, None]] * 300
        first.handle("remove", keys[:10], {})
        second = LeaderGuard(MasterConfig(), b, _Lease(etcd, b.leader_key, b"B"))
        with pytest.raises(ValueError, match="not leader"):  # A holds the key: B's recovery is fenced
            second.handle("register_segment", [[_wire("s3", 4096), 1, 4096]], {})
        assert not second.elector.leading
        etcd.txn([], [put_op(a.leader_key, b"B")])  # B now holds the key
        with pytest.raises(ValueError, match="not leader"):  # A's next write is refused
            first.handle("remove", keys[10:11], {})
        second.elector.leading = True
        got = second.handle("get", keys, {})
        assert all(c != OK for c, _ in got[:10]) and all(c == OK for c, _ in got[10:])  # o10: remove refused
        assert [v[3] for _, v in got[10:]] == list(range(10, 300))  # checksums recovered
        assert all(second.table.get(k).pin == 2 for k in keys[10:])
        assert sorted(second.recovered.items()) == [
            ("disk_only", 0),
            ("dropped", 0),
            ("flight_bytes", 0),
            ("manifest_objects", 0),
            ("objects", 290),
            ("pending", 0),
            ("segments", 2),
            ("short", 0),
            ("slab_bytes", 0),
            ("tasks", 0),
        ]
        assert [sorted(map(tuple, v)) for _, v in placed[10:]] == [sorted(map(tuple, v[1])) for _, v in got[10:]]
        [(code, fresh)] = second.handle("put_start", [["new", 1 << 19]], {"replicas": 2})
        assert code == OK and len(segs) == 2
        for seg, _, off in fresh:  # the recovered allocators never hand out a used byte
            assert all(
                seg != s or off >= o + n or o >= off + (1 << 19)
                for i, (_, v) in enumerate(placed[10:], 10)
                for s, _, o in v
                for n in [100 + i]
            )


def test_hostile_journal_values_are_skipped_on_recovery(caplog):
    """Real etcd: values under the cluster's prefix that are not the journal's (a nested checksum, a string
    size, a truncated value, a descriptor of the wrong shape) are skipped with a warning naming their key; the
    valid objects recover and serve, and nothing invalid reaches the object table (issue #11)."""
    import msgpack

    with etcd_server() as server:
        etcd = Etcd(server.url)
        a, b = EtcdJournal(etcd, "/kvp/hostile"), EtcdJournal(etcd, "/kvp/hostile")
        assert etcd.create(a.leader_key, b"A", etcd.lease(10))
        first = LeaderGuard(MasterConfig(), a, _Lease(etcd, a.leader_key, b"A"))
        [(code, seg)] = first.handle("register_segment", [[_wire("s1", 1 << 20), 1, 1 << 20]], {})
        assert first.handle("put_start", [["good", 100]], {})[0][0] == OK
        first.handle("put_commit", ["good"], {"xxh3": [42]})
        hostile = {
            "/obj/nested": msgpack.packb([64, [[seg, 0]], [[[[1]]]], 0]),
            "/obj/strsize": msgpack.packb(["64", [[seg, 128]], None, 0]),
            "/obj/truncated": msgpack.packb([64, [[seg, 256]], 7, 0])[:-3],
            "/seg/bad": msgpack.packb([{"v": 1, "segment_id": [1]}, 1, 4096]),
            "/flight/notanid": msgpack.packb([seg, 0, 4096]),
            "/flight/7": msgpack.packb([seg, 4096, 0]),
        }  # end before start
        etcd.txn([], [put_op("/kvp/hostile" + k, v) for k, v in hostile.items()])
        etcd.txn([], [put_op(a.leader_key, b"B")])
        second = LeaderGuard(MasterConfig(), b, _Lease(etcd, b.leader_key, b"B"))
        [(code, value)] = second.handle("get", ["good"], {})
        assert code == OK and value[3] == 42
        assert second.handle("exists", ["nested", "strsize", "truncated"], {}) == [False] * 3
        assert sorted(second.recovered.items()) == [
            ("disk_only", 0),
            ("dropped", 0),
            ("flight_bytes", 0),
            ("manifest_objects", 0),
            ("objects", 1),
            ("pending", 0),
            ("segments", 1),
            ("short", 0),
            ("slab_bytes", 0),
            ("tasks", 0),
        ]
        skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
        assert len(skipped) == 6 and all(any(k in m for m in skipped) for k in hostile)


@contextlib.contextmanager
def _guards(prefix: str, cfg: MasterConfig):
    """Real etcd: yields (etcd, leader A's LeaderGuard, fail_over), where fail_over() hands the leader key to B
    and returns B's LeaderGuard (recovered from the journal)."""
    with etcd_server() as server:
        etcd = Etcd(server.url)
        a, b = EtcdJournal(etcd, prefix), EtcdJournal(etcd, prefix)
        assert etcd.create(a.leader_key, b"A", etcd.lease(10))

        def fail_over():
            etcd.txn([], [put_op(a.leader_key, b"B")])
            return LeaderGuard(cfg, b, _Lease(etcd, b.leader_key, b"B"))

        yield etcd, LeaderGuard(cfg, a, _Lease(etcd, a.leader_key, b"A")), fail_over


def test_a_new_leader_learns_pending_puts_and_holds_slabs():
    """Issue #30 item 10, in process with real etcd: a put started on leader A and committed on B after the
    failover is acknowledged there (B learned it); no put placed by B lands on its bytes or on the free part of
    a slab A reserved (B holds it for put_timeout_ms, then frees it); B deletes the slab's record."""
    cfg, mib = MasterConfig(put_timeout_ms=1500), 1 << 20
    with _guards("/kvp/pend", cfg) as (etcd, first, fail_over):
        [(code, seg)] = first.handle("register_segment", [[_wire("s1", 64 * mib), 1, 64 * mib]], {})
        [(code, locs)] = first.handle("put_start", [["p", mib]], {})
        assert code == OK
        [(code, (_, _, _, start, length, _, _))] = first.handle("reserve", [mib], {})
        assert code == OK and length == mib  # a slab is 1/64 of the largest segment
        second = fail_over()
        fresh = second.handle("put_start", [[f"n{i}", mib] for i in range(63)], {})
        assert second.recovered["pending"] == 1 and second.recovered["slab_bytes"] == mib
        placed = [v[0][2] for c, v in fresh if c == OK]
        assert len(placed) == 62 and fresh[62][0] == STORE_FULL  # 64 MiB less A's put and A's slab
        assert all(o + mib <= t or t + mib <= o for o in placed for t in (locs[0][2], start))
        assert second.handle("put_commit", ["p"], {"xxh3": [7]}) == [[OK, None]]  # A's writer commits on B
        assert second.handle("get", ["p"], {})[0][1][1] == [list(locs[0])]
        assert etcd.range_prefix("/kvp/pend/slab/") == []
        second.handle("put_abort", [f"n{i}" for i in range(62)], {})
        time.sleep(cfg.put_timeout_ms / 1000 + 0.2)
        second.tick()  # past put_timeout_ms: the slab's bytes are free
        assert [c for c, _ in second.handle("put_start", [[f"m{i}", mib] for i in range(63)], {})] == [OK] * 63


def test_a_new_leader_answers_replica_tasks_and_holds_a_copy_in_flight():
    """Issue #30 item 10, in process with real etcd: leader A finishes one copy task and starts another (its
    destination allocated, the node's write not reported); after the failover leader B answers task_query for
    both: the first SUCCESS with the same creation time, the second FAILED naming the failover (B cannot follow
    A's write); B places no put on the second copy's destination until put_timeout_ms has passed."""
    cfg, kib = MasterConfig(put_timeout_ms=1500), 1 << 10
    with _guards("/kvp/task", cfg) as (etcd, first, fail_over):
        [(_, s1)] = first.handle("register_segment", [[_wire("s1", 64 * kib), 1, 64 * kib]], {})
        assert [c for c, _ in first.handle("put_start", [["k1", 4 * kib], ["k2", 4 * kib]], {})] == [OK, OK]
        first.handle("put_commit", ["k1", "k2"], {"xxh3": [1, 2]})
        [(_, s2)] = first.handle("register_segment", [[_wire("s2", 64 * kib), 1, 64 * kib]], {})
        for seg in (s1, s2):
            assert first.handle("tier_register", [[seg, "", 0, [], ""]], {})[0][0] == OK
        [(code, t1)] = first.handle("task_create", [["copy", "k1", "", [s2]]], {})
        assert code == OK
        [(_, ([cmd], _))] = first.handle("tier_poll", [s1], {})
        assert cmd[0] == "migrate" and cmd[1] == "k1"
        first.handle("tier_done", [["migrate", "k1", True, None, cmd[7]]], {"segment": s1})
        [(code, t2)] = first.handle("task_create", [["copy", "k2", "", [s2]]], {})
        [(_, ([cmd2], _))] = first.handle("tier_poll", [s1], {})
        dest = cmd2[6]  # the offset on s2 A's node may still write k2 to
        [(_, row1)], [(_, row2)] = (first.handle("task_query", [t], {}) for t in (t1, t2))
        assert (row1[3], row2[3]) == ("SUCCESS", "PROCESSING")
        second = fail_over()
        [(c1, again1)], [(c2, again2)] = (second.handle("task_query", [t], {}) for t in (t1, t2))
        assert second.recovered["tasks"] == 2 and (c1, c2) == (OK, OK)
        assert again1 == row1  # same id, kind, status, times, source
        assert again2[3] == "FAILED" and "failed over" in again2[7] and again2[4] == row2[4]
        assert any(r[0] == s2 for r in second.handle("get", ["k1"], {})[0][1][1])  # A's finished copy stays
        placed = second.handle("put_start", [[f"n{i}", 4 * kib] for i in range(32)], {"segment": s2})
        offs = [off for c, v in placed if c == OK for seg, _, off in v if seg == s2]
        assert offs and all(o + 4 * kib <= dest or dest + 4 * kib <= o for o in offs)


def test_a_new_leader_holds_disk_tier_flights_in_flight():
    """In process with real etcd: leader A drains s1 (its nodes' migrate writes to s2 allocated, not reported)
    and starts a promotion of a disk-only object into s2; after the failover leader B holds both destinations
    (each journaled as /flight/ID) from its puts until put_timeout_ms, deletes the records, and still serves
    both objects where the journal has them. A flight that ends normally leaves no record."""
    cfg, kib = MasterConfig(put_timeout_ms=1500), 1 << 10
    with _guards("/kvp/flight", cfg) as (etcd, first, fail_over):
        [(_, s1)] = first.handle("register_segment", [[_wire("s1", 64 * kib), 1, 64 * kib]], {})
        first.handle("put_start", [["k1", 4 * kib]], {})
        first.handle("put_commit", ["k1"], {"xxh3": [1]})
        [(_, s2)] = first.handle("register_segment", [[_wire("s2", 64 * kib), 1, 64 * kib]], {})
        assert first.handle("tier_register", [[s1, "", 0, [], "d1"]], {})[0][0] == OK
        assert (
            first.handle("tier_register", [[s2, "127.0.0.1:1", 1 << 20, [["disk", 4 * kib, 9]], "d2"]], {})[0][0] == OK
        )
        [(code, (off, _))] = first.handle("promote_start", ["disk"], {"segment": s2})
        assert code == OK
        first.handle("promote_commit", [["disk", True, None]], {"segment": s2})  # ended: record gone
        assert etcd.range_prefix("/kvp/flight/flight/") == []
        first.handle("put_start", [["d2", 4 * kib]], {})
        first.handle("put_commit", ["d2"], {})
        first.handle("remove", ["disk"], {})
        first.handle("tier_register", [[s2, "127.0.0.1:1", 1 << 20, [["disk2", 4 * kib, 9]], "d2"]], {"more": 1})
        [(code, (promote_off, _))] = first.handle("promote_start", ["disk2"], {"segment": s2})
        assert code == OK
        assert first.handle("drain", [s1], {}) == [[OK, None]]
        [(_, (cmds, _))] = first.handle("tier_poll", [s1], {})
        assert {c[1] for c in cmds} >= {"k1"} and all(c[0] == "migrate" and c[4] == s2 for c in cmds)
        dests = [c[6] for c in cmds] + [promote_off]  # where A's nodes may still write
        assert len(etcd.range_prefix("/kvp/flight/flight/")) == len(dests)
        second = fail_over()
        assert second.handle("get", ["k1"], {})[0][1][1][0][0] == s1  # not moved: A's copy never landed
        placed = second.handle("put_start", [[f"n{i}", 4 * kib] for i in range(32)], {"segment": s2})
        assert second.recovered["flight_bytes"] == 4 * kib * len(dests)
        assert etcd.range_prefix("/kvp/flight/flight/") == []
        offs = [off for c, v in placed if c == OK for seg, _, off in v if seg == s2]
        assert offs and all(o + 4 * kib <= d or d + 4 * kib <= o for o in offs for d in dests)
        assert second.handle("promote_commit", [["disk2", True, None]], {"segment": s2})[0][0] == NOT_FOUND


def test_repair_tasks_are_not_journaled_and_a_new_leader_ends_task_records_in_few_transactions():
    """HA recovery time (issue #34): re-replication after a segment loss starts internal copy tasks that write no
    task record (their flights are journaled, so a new leader still holds the destinations), and a new leader
    ends the old one's 300 running user tasks in a handful of etcd transactions, not one per task (18,146 tasks
    took 30 s with no leader, one write each)."""
    cfg, kib, users = MasterConfig(put_timeout_ms=1500), 1 << 10, 300
    with _guards("/kvp/rt", cfg) as (etcd, first, fail_over):
        segs = [first.handle("register_segment", [[_wire(f"s{i}", 4 << 20), 1, 4 << 20]], {})[0][1] for i in range(3)]
        for seg in segs:
            assert first.handle("tier_register", [[seg, "", 0, [], ""]], {})[0][0] == OK
        keys = [f"u{i}" for i in range(users)] + [f"r{i}" for i in range(100)]
        placed = dict(zip(keys, first.handle("put_start", [[k, kib] for k in keys], {"replicas": 2})))
        first.handle("put_commit", keys, {"xxh3": [1] * len(keys)})
        for k in keys[:users]:
            spare = next(s for s in segs if s not in {loc[0] for loc in placed[k][1]})
            assert first.handle("task_create", [["copy", k, "", [spare]]], {})[0][0] == OK
        assert len(etcd.range_prefix("/kvp/rt/task/")) == users
        assert first.handle("unregister", [segs[0]], {}) == [[OK, None]]
        first.tick()
        assert first.inner.counters["repairs_started"] > 0
        assert len(etcd.range_prefix("/kvp/rt/task/")) == users  # the repairs wrote no task record
        assert etcd.range_prefix("/kvp/rt/flight/")  # ... but their flights are journaled
        txns, real = [], etcd.txn
        etcd.txn = lambda *a, **kw: txns.append(1) or real(*a, **kw)
        second = fail_over()
        second.handle("status", [], {})  # the first op elects B: it recovers from the journal
        assert second.recovered["tasks"] == users
        assert len(txns) <= 1 + 2 * -(-users // 128)  # the hand-over, then the task records' rewrite in batches


def test_a_slow_takeover_gives_every_segment_a_full_heartbeat_timeout():
    """A new leader whose recovery took longer than heartbeat timeout + suspect grace (46 s with 15,625 replica
    tasks in the 60 s SIGSTOP run) removed every segment at its first sweep, each "silent" since recovery began:
    every object lost a replica at once. Now each segment's clock starts when the leader starts serving. (The
    slow recovery is a sleep in the journal's task load: 2.5 s here stands in for a big journal.)"""
    cfg, kib = MasterConfig(heartbeat_timeout_ms=1000, suspect_grace_ms=1000), 1 << 10
    with _guards("/kvp/slow", cfg) as (etcd, first, fail_over):
        [(_, s1)] = first.handle("register_segment", [[_wire("s1", 64 * kib), 1, 64 * kib]], {})
        keys = [f"k{i}" for i in range(8)]
        first.handle("put_start", [[k, kib] for k in keys], {})
        first.handle("put_commit", keys, {})
        second = fail_over()
        load = second.journal.load_tasks
        second.journal.load_tasks = lambda: (time.sleep(2.5), load())[1]
        second.handle("status", [], {})  # the first op: recovery, 2.5 s
        second.journal.load_tasks = load
        second.tick()
        assert second.handle("exists", keys, {}) == [True] * len(keys)
        assert [s["name"] for s in second.handle("status", [], {})["segments"]] == [s1]


def _segment_of_64(first):
    """Segment s1 (256 KiB, owner A) holding 64 committed 1 KiB objects k0..k63 (checksums 0..63): (its wire
    descriptor, its name, the keys)."""
    kib = 1 << 10
    wire = _wire("s1", 256 * kib)
    [(_, s1)] = first.handle("register_segment", [[wire, 1, 256 * kib]], {"owner": "A"})
    keys = [f"k{i}" for i in range(64)]
    first.handle("put_start", [[k, kib] for k in keys], {})
    first.handle("put_commit", keys, {"xxh3": list(range(64))})
    return wire, s1, keys


def test_a_parked_segments_objects_survive_a_failover_and_come_back_in_one_transaction():
    """The fourth 60 s SIGSTOP run lost 1,075 objects: a node removed for silence under one leader left its
    manifest in that leader's memory, the objects' records were deleted, and the restore's rewrite of ~100,000
    records did not finish before that leader was killed. Now the segment is parked in the journal (its objects'
    records kept): leader A removes s1 for silence, fails over to B, and s1's process re-registering with B gets
    all 64 objects back (same places, sizes, checksums), in one etcd transaction; no parked record is left."""
    cfg, kib = MasterConfig(heartbeat_timeout_ms=300, suspect_grace_ms=300), 1 << 10
    with _guards("/kvp/park", cfg) as (etcd, first, fail_over):
        wire, s1, keys = _segment_of_64(first)
        before = first.handle("get", keys, {})
        time.sleep(0.8)
        first.tick()  # silent past timeout + grace: removed, its objects in its manifest
        assert first.handle("exists", keys, {}) == [False] * 64 and etcd.range_prefix("/kvp/park/parked/")
        second = fail_over()
        second.handle("status", [], {})
        assert second.recovered["manifest_objects"] == 64
        txns, real = [], etcd.txn
        etcd.txn = lambda *a, **kw: txns.append(1) or real(*a, **kw)
        assert second.handle("register_segment", [[wire, 1, 256 * kib]], {"owner": "A"}) == [[OK, s1]]
        etcd.txn = real
        got = second.handle("get", keys, {})
        assert [(c, v[0], v[1], v[3]) for c, v in got] == [(c, v[0], v[1], v[3]) for c, v in before]
        assert etcd.range_prefix("/kvp/park/parked/") == [] and len(txns) == 1


def test_a_parked_manifest_taken_by_another_process_deletes_its_records():
    """A parked segment's name registered by another process (a new memory): its manifest is dropped, and with it
    the records of its objects and the parked record, so no later leader brings them back."""
    cfg, kib = MasterConfig(heartbeat_timeout_ms=300, suspect_grace_ms=300), 1 << 10
    with _guards("/kvp/park2", cfg) as (etcd, first, _):
        wire = _wire("s1", 256 * kib)
        first.handle("register_segment", [[wire, 1, 256 * kib]], {"owner": "A"})
        keys = [f"k{i}" for i in range(16)]
        first.handle("put_start", [[k, kib] for k in keys], {})
        first.handle("put_commit", keys, {})
        time.sleep(0.8)
        first.tick()
        assert len(etcd.range_prefix("/kvp/park2/obj/")) == 16
        first.handle("register_segment", [[wire, 1, 256 * kib]], {"owner": "B"})
        assert etcd.range_prefix("/kvp/park2/obj/") == [] and etcd.range_prefix("/kvp/park2/parked/") == []
        assert first.handle("exists", keys, {}) == [False] * 16


def test_a_key_put_again_while_its_segment_was_parked_keeps_its_record_when_the_segment_returns():
    """The 10-minute 60 s SIGSTOP run (seed 7) lost 9 acknowledged objects: each had its last replica on a node
    removed for silence and was put again (to another node) before that node came back; the restore skipped it
    (the new copy wins) but then deleted the manifest leftovers' journal records, the new copy's among them, so
    the next leader did not know it. Here: s1 removed for silence, 8 of its keys put again on s2, s1 returns
    (the other 56 restored), then a fail-over: all 64 keys are there, the 8 at their new place."""
    cfg, kib = MasterConfig(heartbeat_timeout_ms=300, suspect_grace_ms=300), 1 << 10
    with _guards("/kvp/again", cfg) as (etcd, first, fail_over):
        wire, s1, keys = _segment_of_64(first)
        time.sleep(0.8)
        first.tick()  # silent past timeout + grace: removed, its objects in its manifest
        [(_, s2)] = first.handle("register_segment", [[_wire("s2", 256 * kib), 1, 256 * kib]], {"owner": "B"})
        assert [c for c, _ in first.handle("put_start", [[k, 2 * kib] for k in keys[:8]], {})] == [OK] * 8
        first.handle("put_commit", keys[:8], {"xxh3": list(range(100, 108))})
        assert first.handle("register_segment", [[wire, 1, 256 * kib]], {"owner": "A"}) == [[OK, s1]]
        assert first.handle("exists", keys, {}) == [True] * 64
        second = fail_over()
        got = second.handle("get", keys, {})
        assert [c for c, _ in got] == [OK] * 64
        assert [(v[0], v[1][0][0], v[3]) for _, v in got[:8]] == [(2 * kib, s2, 100 + i) for i in range(8)]
        assert {v[1][0][0] for _, v in got[8:]} == {s1}


def _naming(etcd, prefix: str, seg: str) -> int:
    """Object records under ``prefix`` whose replica list names segment ``seg``."""
    return sum(any(n == seg for n, _ in decode_object(v)[1]) for _, v in etcd.range_prefix(prefix + "/obj/"))


def _two_segments_full(first, n: int):
    kib = 1 << 10
    s1, s2 = (first.handle("register_segment", [[_wire(x, 8 << 20), 1, 8 << 20]], {"owner": x})[0][1] for x in "ab")
    keys = [f"k{i}" for i in range(n)]
    for i in range(0, n, 1000):
        part = keys[i : i + 1000]
        assert [c for c, _ in first.handle("put_start", [[k, kib] for k in part], {"replicas": 2})] == [OK] * len(part)
        first.handle("put_commit", part, {"xxh3": list(range(len(part)))})
    return s1, s2, keys


def test_removing_a_segment_rewrites_its_objects_records_over_later_turns(monkeypatch):
    """A leader removing a segment rewrote every record naming it in that op's turn: three nodes leaving with
    242,583 replicas kept the leader from answering (or stopping) for over 15 s at the cluster run's stop. Now the
    op persists the removal and one turn's share (LATER_PER_TURN) of the rewrites, later turns the rest; a record
    not rewritten yet reads right on a new leader (the removed segment is unknown there: the object is short, and
    queued for a copy), and that leader rewrites it too."""
    monkeypatch.setattr(ha_journal, "LATER_PER_TURN", 256)
    with _guards("/kvp/lazy", MasterConfig(put_timeout_ms=1500)) as (etcd, first, fail_over):
        s1, s2, keys = _two_segments_full(first, 3000)
        txns, real = [], etcd.txn
        etcd.txn = lambda *a, **kw: txns.append(1) or real(*a, **kw)
        assert first.handle("unregister", [s1], {"owner": "a"}) == [[OK, None]]
        etcd.txn = real
        assert len(txns) <= 1 + 256 // 128  # not 3000 / 128 = 24 transactions
        assert _naming(etcd, "/kvp/lazy", s1) == 3000 - 256 == first.journal.pending_rewrites()
        first.handle("status", [], {})  # a later turn: its share
        assert _naming(etcd, "/kvp/lazy", s1) == 3000 - 512
        second = fail_over()
        got = second.handle("get", keys, {})
        assert [c for c, _ in got] == [OK] * 3000 and {v[1][0][0] for _, v in got} == {s2}
        assert second.recovered["short"] == 3000 and 0 < second.journal.pending_rewrites() <= 3000 - 512
        for _ in range(12):
            second.handle("status", [], {})
        assert _naming(etcd, "/kvp/lazy", s1) == 0 and second.journal.pending_rewrites() == 0


def test_objects_losing_their_last_replica_have_their_records_deleted_over_later_turns(monkeypatch):
    """At the 10-minute run's stop every node unregistered: objects losing their last replica had their records
    deleted in that op's turn, one etcd write each (~1,900 transactions for 240,000 objects), and the leader was
    SIGKILLed 15 s after its SIGTERM. Now those deletes are deferred too: the op costs a few transactions, a new
    leader drops the records left (they name only removed segments) and deletes them itself, and a name
    registered again first deletes the records naming it."""
    monkeypatch.setattr(ha_journal, "LATER_PER_TURN", 256)
    with _guards("/kvp/gone", MasterConfig(put_timeout_ms=1500)) as (etcd, first, fail_over):
        s1, s2, keys = _two_segments_full(first, 3000)
        assert first.handle("unregister", [s1], {"owner": "a"}) == [[OK, None]]
        for _ in range(12):
            first.handle("status", [], {})  # s1's rewrites persisted: every record names s2 only
        txns, real = [], etcd.txn
        etcd.txn = lambda *a, **kw: txns.append(1) or real(*a, **kw)
        assert first.handle("unregister", [s2], {"owner": "b"}) == [[OK, None]]
        etcd.txn = real
        assert len(txns) <= 1 + 256 // 128  # not 3000 / 128 = 24 transactions
        assert len(etcd.range_prefix("/kvp/gone/obj/")) == 3000 - 256 == first.journal.pending_rewrites()
        assert first.handle("exists", keys, {}) == [False] * 3000  # a later turn: its share
        assert len(etcd.range_prefix("/kvp/gone/obj/")) == 3000 - 512
        second = fail_over()
        assert second.handle("exists", keys, {}) == [False] * 3000  # takes over, and persists a first share
        assert second.recovered["objects"] == 0 and second.recovered["dropped"] == 3000 - 512
        assert len(etcd.range_prefix("/kvp/gone/obj/")) == 3000 - 768
        assert second.handle("register_segment", [[_wire("b", 8 << 20), 1, 8 << 20]], {"owner": "b"}) == [[OK, s2]]
        assert etcd.range_prefix("/kvp/gone/obj/") == [] and second.journal.pending_rewrites() == 0


def test_a_removed_segments_name_registered_again_first_rewrites_the_records_naming_it(monkeypatch):
    """Records still naming a removed segment would name its new incarnation (other bytes) once that name is
    registered again: they are all rewritten in the registration's own batch."""
    monkeypatch.setattr(ha_journal, "LATER_PER_TURN", 256)
    with _guards("/kvp/lazy2", MasterConfig(put_timeout_ms=1500)) as (etcd, first, _):
        s1, s2, keys = _two_segments_full(first, 2000)
        assert first.handle("unregister", [s1], {"owner": "a"}) == [[OK, None]]
        assert _naming(etcd, "/kvp/lazy2", s1) > 0
        assert first.handle("register_segment", [[_wire("a", 8 << 20), 1, 8 << 20]], {"owner": "a"}) == [[OK, s1]]
        assert _naming(etcd, "/kvp/lazy2", s1) == 0 and first.journal.pending_rewrites() == 0
        assert {v[1][0][0] for _, v in first.handle("get", keys, {})} == {s2}


def test_a_new_leader_copies_the_objects_a_lost_segment_left_short():
    """The re-replication queue was the leader's memory: objects short of a replica when the leader failed over
    stayed short for good (one more node loss took them). Now a queued object's record says how many replicas it
    had: leader A loses s1 (20 objects down to 1 replica, none copied: s2 holds them all, no third segment),
    fails over to B, a third segment comes, and B copies all 20 there."""
    cfg, kib = MasterConfig(put_timeout_ms=1500), 1 << 10
    with _guards("/kvp/short", cfg) as (etcd, first, fail_over):
        s1, s2 = (first.handle("register_segment", [[_wire(n, 256 * kib), 1, 256 * kib]], {})[0][1] for n in "ab")
        keys = [f"k{i}" for i in range(20)]
        assert [c for c, _ in first.handle("put_start", [[k, kib] for k in keys], {"replicas": 2})] == [OK] * 20
        first.handle("put_commit", keys, {"xxh3": list(range(20))})
        assert first.handle("unregister", [s1], {}) == [[OK, None]]
        first.tick()
        assert first.handle("status", [], {})["repairs_queued"] == 20  # no segment to copy to yet
        second = fail_over()
        second.handle("status", [], {})  # the first op elects B: it recovers from the journal
        assert second.recovered["short"] == 20
        [(_, s3)] = second.handle("register_segment", [[_wire("c", 256 * kib), 1, 256 * kib]], {})
        for seg in (s2, s3):
            assert second.handle("tier_register", [[seg, "", 0, [], ""]], {})[0][0] == OK
        second.tick()
        assert second.inner.counters["repairs_started"] == 20
        [(_, (cmds, _))] = second.handle("tier_poll", [s2], {})
        assert cmds and {c[1] for c in cmds} <= set(keys) and all(c[0] == "migrate" for c in cmds)
