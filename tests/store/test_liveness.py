"""Suspect segments and manifests (master/liveness.py, issue #30 item 7) in MasterService with a fake clock: a
segment silent past heartbeat_timeout_ms gets no placement and its replicas are not read, a heartbeat within
the suspect grace resumes it with every object, removal after the grace keeps a manifest that only the same
process (owner token) and size get back, a key put again meanwhile wins, and a manifest ages out.
tests/security/test_paused_node.py does the same with real processes and SIGSTOP."""

import pytest

from kvplugins.store.config import MasterConfig
from kvplugins.store.master import liveness
from kvplugins.store.master.service import MasterService
from kvplugins.store.wire.protocol import NOT_FOUND, OK, STORE_FULL

TIMEOUT_S, GRACE_S = 2.0, 10.0


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def m():
    svc = MasterService(
        MasterConfig(
            heartbeat_timeout_ms=int(TIMEOUT_S * 1000),
            suspect_grace_ms=int(GRACE_S * 1000),
            lease_ttl_ms=1000,
            put_timeout_ms=2000,
            alloc_align=64,
        ),
        clock=Clock(),
    )
    return svc


def reg(m, seg_id: str, size: int = 64 << 10, owner: str = "owner-a"):
    wire = {"v": 1, "segment_id": seg_id, "host_id": "h", "transports": {}, "regions": [[1, size, None]]}
    return m.handle("register_segment", [[wire, 1, size]], {"owner": owner})[0]


def put(m, key: str, size: int = 100, **opts) -> list:
    [(code, locs)] = m.handle("put_start", [[key, size]], opts)
    assert code == OK, locs
    assert m.handle("put_commit", [key], {"xxh3": [hash(key) & (2**64 - 1)]}) == [[OK, None]]
    return locs


def silence(m, seconds: float, *beating: str) -> None:
    """Advance the clock ``seconds`` in 0.5 s steps; the segments ``beating`` heartbeat, the others are silent."""
    for _ in range(int(seconds * 2)):
        m.clock.t += 0.5
        if beating:
            m.handle("heartbeat", list(beating), {})
        m.tick()


def test_silent_segment_is_suspect_not_read_not_placed_and_resumes(m):
    (_, s1), (_, s2) = reg(m, "s1"), reg(m, "s2")
    on = {put(m, f"k{i}")[0][0]: f"k{i}" for i in range(4)}  # placement alternates: keys on both
    assert set(on) == {s1, s2}
    silence(m, TIMEOUT_S + 1, s2)
    st = m.handle("status", [], {})
    assert {s["name"]: s["suspect"] for s in st["segments"]} == {s1: True, s2: False}
    assert st["segments_suspect"] == 1 and st["segments_lost"] == 0
    key1, key2 = on[s1], on[s2]
    assert m.handle("get", [key1], {}) == [[NOT_FOUND, None]] and m.handle("get", [key2], {})[0][0] == OK
    assert m.handle("exists", [key1, key2], {}) == [False, True]
    assert m.handle("exists_prefix", [key2, key1, key2], {}) == 1
    assert m.handle("get", [key1, key2], {"cols": 1})[1][0] == -1  # the column answer: a miss too
    for i in range(20):
        assert put(m, f"new{i}")[0][0] == s2  # no placement on the suspect one
    m.handle("heartbeat", [s1], {})
    assert m.handle("get", [key1], {})[0][0] == OK and m.handle("exists", [key1], {}) == [True]
    assert not any(s["suspect"] for s in m.handle("status", [], {})["segments"])
    assert put(m, "back")[0][0] == s1  # most free space: placed again


def test_reads_go_to_the_live_replica(m):
    (_, s1), (_, s2) = reg(m, "s1"), reg(m, "s2")
    locs = put(m, "r", replicas=2)
    assert {loc[0] for loc in locs} == {s1, s2}
    silence(m, TIMEOUT_S + 1, s2)
    [(code, (size, got, _, _))] = m.handle("get", ["r"], {})
    assert code == OK and got == [loc for loc in locs if loc[0] == s2]
    ttl, sizes, names, regions, idx, offs, more, sums, disk = m.handle("get", ["r"], {"cols": 1})
    assert sizes == [100] and names[idx[0]] == s2 and offs == [got[0][2]] and more == {}


def test_all_suspect_is_store_full_naming_them(m):
    _, s1 = reg(m, "s1")
    silence(m, TIMEOUT_S + 1)
    [(code, why)] = m.handle("put_start", [["x", 10]], {})
    assert code == STORE_FULL and "every segment is suspect" in why and s1 in why


def test_put_of_two_replicas_with_one_live_segment_is_refused_not_acknowledged_with_one(m):
    """A put is never acknowledged with fewer copies than it asked for and the pool could hold: with 2 segments
    registered and one suspect, a 2-replica put is StoreFull naming the suspect one (a 1-replica put still
    lands); once the silent one heartbeats again the put gets both. One registered segment stores one copy."""
    (_, s1), (_, s2) = reg(m, "s1"), reg(m, "s2")
    silence(m, TIMEOUT_S + 1, s2)
    [(code, why)] = m.handle("put_start", [["two", 100]], {"replicas": 2})
    assert code == STORE_FULL and "replicas=2" in why and "only 1 of the 2" in why and s1 in why, why
    assert "two" not in m.table
    assert [loc[0] for loc in put(m, "one")] == [s2]
    m.handle("heartbeat", [s1], {})
    assert {loc[0] for loc in put(m, "two", replicas=2)} == {s1, s2}
    single = MasterService(MasterConfig(alloc_align=64), clock=Clock())
    (_, s0) = reg(single, "s0")
    assert [loc[0] for loc in put(single, "k", replicas=2)] == [s0]


def test_a_removed_key_in_the_repair_queue_does_not_stop_the_sweep(m):
    """An object queued for re-replication (it lost a replica with a removed segment) and then removed: the
    sweep skips it and goes on. It raised TypeError (a key gone compared with its old view) on every tick from
    then on, so no repair, eviction or shard sweep ran again (the 60 s SIGSTOP cluster run, issue #34)."""
    _, (_, s2), (_, s3) = reg(m, "s1"), reg(m, "s2"), reg(m, "s3")
    for k in ("a", "b"):
        put(m, k, replicas=3)
    silence(m, TIMEOUT_S + GRACE_S + 1, s2, s3)  # s1 removed: a and b are short of a replica
    assert set(m.repairs.queue) == {"a", "b"}
    m.handle("remove", ["a"], {})
    m.clock.t += 0.5
    m.tick()
    assert "a" not in m.repairs.queue and "b" in m.repairs.queue


def test_removed_after_grace_then_same_process_gets_its_objects_back(m):
    (_, s1), (_, s2) = reg(m, "s1", owner="A"), reg(m, "s2", owner="B")
    placed = {f"k{i}": put(m, f"k{i}")[0] for i in range(8)}
    mine = {k: loc for k, loc in placed.items() if loc[0] == s1}
    gets = {k: m.handle("get", [k], {})[0] for k in mine}
    silence(m, TIMEOUT_S + GRACE_S + 1, s2)
    st = m.handle("status", [], {})
    assert [s["name"] for s in st["segments"]] == [s2] and st["objects_lost"] == len(mine) > 0
    assert st["manifest_objects"] == len(mine)
    again = sorted(mine)[0]  # put again meanwhile (on s2): that copy wins
    put(m, again, 50)
    assert reg(m, "s1", owner="A") == [OK, s1]  # the same process re-registers (its heartbeat got NOT_FOUND)
    st = m.handle("status", [], {})
    assert st["objects_restored"] == len(mine) - 1 and st["manifest_objects"] == 0
    for key in mine:
        [(code, answer)] = m.handle("get", [key], {})
        if key == again:
            assert answer[0] == 50 and answer[1][0][0] == s2
        else:  # same offset, size and checksum as before
            assert (code, answer[0], answer[1], answer[3]) == (OK, *gets[key][1][:2], gets[key][1][3])
    fresh = put(m, "after", 100)  # the restored ranges are allocated: never handed out again
    assert all((fresh[0][0], fresh[0][2]) != (loc[0], loc[2]) for k, loc in mine.items() if k != again)


def test_a_repeated_registration_keeps_the_segment_and_its_objects(m):
    """The node's register_segment resent (its RPC timed out and was retried: three registrations of one node
    within 3 s in the 60 s SIGSTOP cluster run) is the same live segment, not new memory: before, each repeat
    replaced it with an empty one and dropped every replica on it (objects restored from its manifest a moment
    earlier were lost)."""
    (_, s1), _ = reg(m, "s1", owner="A"), reg(m, "s2", owner="B")
    placed = {f"k{i}": put(m, f"k{i}")[0] for i in range(8)}
    mine = sorted(k for k, loc in placed.items() if loc[0] == s1)
    assert mine and reg(m, "s1", owner="A") == [OK, s1]
    assert m.handle("exists", mine, {}) == [True] * len(mine)
    fresh = put(m, "after", 100, segment=s1)  # the space of its objects is still allocated
    assert all((fresh[0][0], fresh[0][2]) != (placed[k][0], placed[k][2]) for k in mine)
    assert reg(m, "s1", size=128 << 10, owner="A") == [OK, s1]  # another size: new memory, its objects gone
    assert m.handle("exists", mine, {}) == [False] * len(mine)


def test_another_process_or_size_gets_nothing_back(m):
    (_, s1), (_, s2) = reg(m, "s1", owner="A"), reg(m, "s2", owner="B")
    keys = [k for k in (f"k{i}" for i in range(6)) if put(m, k)[0][0] == s1]
    silence(m, TIMEOUT_S + GRACE_S + 1, s2)
    assert reg(m, "s1", owner="intruder") == [OK, s1]  # the name is free once removed
    assert m.handle("exists", keys, {}) == [False] * len(keys)
    assert m.handle("status", [], {})["objects_restored"] == 0 and len(m.manifests) == 0


def test_manifest_ages_out(m):
    (_, s1), (_, s2) = reg(m, "s1", owner="A"), reg(m, "s2", owner="B")
    keys = [k for k in (f"k{i}" for i in range(6)) if put(m, k)[0][0] == s1]
    silence(m, TIMEOUT_S + GRACE_S + 1, s2)
    assert len(m.manifests) == len(keys)
    m.clock.t += liveness.MANIFEST_KEEP_S
    m.handle("heartbeat", [s2], {})
    m.tick()
    assert len(m.manifests) == 0
    assert reg(m, "s1", owner="A") == [OK, s1] and m.handle("exists", keys, {}) == [False] * len(keys)


def test_a_replica_reported_corrupt_is_copied_again_from_a_good_one(m):
    """A replica whose bytes failed a reader's checksum is dropped; the object, short of one, is queued for
    re-replication like one that lost a node (repair.py): the next sweep copies it from the surviving replica
    to a segment holding none (before: it stayed at one replica until a node loss took that too)."""
    segs = [reg(m, f"s{i}")[1] for i in range(3)]
    for seg in segs:
        assert m.handle("tier_register", [[seg, "", 0, [], ""]], {})[0][0] == OK
    locs = put(m, "k", replicas=2)
    (bad, bad_off), (good, _) = [(loc[0], loc[2]) for loc in locs]
    assert m.handle("report_corrupt", [["k", bad, bad_off, hash("k") & (2**64 - 1)]], {}) == [[OK, None]]
    assert m.handle("status", [], {})["repairs_queued"] == 1
    m.tick()
    assert m.counters["repairs_started"] == 1
    [(_, (cmds, _))] = m.handle("tier_poll", [good], {})
    assert [c[:2] for c in cmds] == [["migrate", "k"]]
