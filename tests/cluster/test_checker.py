"""The offline checker (checker.py) on made-up histories: each thing it must catch, caught; a clean history passes.
(Pure: no namespaces; the cluster run itself is test_cluster.py.)"""

from __future__ import annotations

from tests.cluster import checker
from tests.cluster.history import Record, digest_of, page_key, value_of
from tests.cluster.nemesis import Window

KEY = page_key("t", "chain0", 0, 4096)


def _rec(op: str, t: float, result: str, client: str = "client2", key: str = KEY, digest: str | None = None) -> Record:
    return Record(t, t + 0.01, client, "h" + client[-1], "kvplugins", op, key, result, digest)


def _check(records, windows=(), exits=None, stats=None, kills=()) -> checker.Verdict:
    return checker.check(list(records), list(windows), exits or {}, stats or {}, {4, 5}, list(kills))


def test_a_clean_history_passes():
    good = digest_of(value_of(KEY))
    v = _check([_rec("put", 1, "ok"), _rec("get", 2, "ok", digest=good), _rec("final_get", 9, "ok", digest=good)])
    assert v.ok and v.acknowledged == 1 and not v.wrong_bytes


def test_wrong_bytes_fail_the_run():
    v = _check([_rec("put", 1, "ok"), _rec("get", 2, "ok", digest=digest_of(b"x" * 4096))])
    assert not v.ok and len(v.wrong_bytes) == 1


def test_an_acknowledged_object_missing_at_the_end_is_lost_unless_every_replica_node_died():
    records = [_rec("put", 1, "ok"), _rec("final_get", 9, "miss")]
    assert len(_check(records).lost_unexplained) == 1
    assert len(_check(records, kills=[3, 4]).lost_explained) == 1  # 2 node kills after the put, 2 replicas
    assert _check([_rec("put", 1, "error"), _rec("final_get", 9, "miss")]).ok  # never acknowledged


def test_a_loss_is_explained_by_a_ring_change_no_older_than_a_masters_view_at_the_puts_start():
    put = Record(10.0, 12.5, "client2", "h2", "kvplugins", "put", KEY, "ok", None)  # a 2.5 s put
    records = [put, _rec("final_get", 30, "miss")]

    def lost(moves):
        return checker.check(records, [], {}, {}, {4, 5}, [], moves).lost_unexplained

    assert lost([10.0 - checker.MAX_VIEW_AGE_S]) == []  # its master may have routed it by the ring before
    assert lost([11.0]) == []  # after its start, before its ack (the old test, ack - 1 s, called this unexplained)
    assert len(lost([10.0 - checker.MAX_VIEW_AGE_S - 0.1])) == 1  # every master saw that change before the put


def test_crashes_and_shared_memory_between_hosts_fail_the_run():
    assert not _check([], exits={"node4": [(-9, True), (1, False)]}).ok
    assert _check([], exits={"node4": [(-9, True), (0, False)]}).ok
    st = {"shm": {"bytes": 4096}, "cma": {"bytes": 0}}
    assert not _check([], stats={"client2": (2, st)}).ok  # host 2 has no node: shm bytes crossed hosts
    assert _check([], stats={"client4": (4, st)}).ok  # its own host's node


def test_unavailability_counts_healthy_clients_only():
    w = Window("kill_leader", ["master2"], [2], start=10.0, end=15.0)
    records = [_rec("get", 9, "ok", client="client3")]
    records += [_rec("get", t, "error", client="client3") for t in (10.5, 11.0, 12.0)]
    records += [_rec("get", 13.5, "ok", client="client3"), _rec("get", 11, "error", client="client2")]
    row = _check(records, windows=[w]).kinds["kill_leader"]
    assert row.failed == 3  # client2 is on the fault's host: not counted
    assert abs(row.max_unavailable_s - 3.01) < 1e-6
