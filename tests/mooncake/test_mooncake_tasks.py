"""Mooncake 0.3.13's replica tasks on our store (issue #19): create_copy_task / create_move_task / query_task run
by the process behind the source segment (master/replica_tasks.py). ``mooncake_tasks_script`` is also run
against a real mooncake_master by tests/mooncake/mooncake_crosscheck.py: its expected codes are Mooncake's."""

import time

import pytest

from helpers.cluster import store_cluster
from kvplugins.mooncake import MooncakeDistributedStore, ReplicateConfig
from kvplugins.store.config import MasterConfig
from kvplugins.store.master.service import MasterService
from kvplugins.store.wire.protocol import INVALID, NOT_FOUND, NOT_NOW, OK


def endpoint(replica) -> str:
    return replica.get_memory_descriptor().buffer_descriptor.transport_endpoint


def wait_task(store, task_id, timeout_s: float = 30.0):
    """The task's QueryTaskResponse once it finished (SUCCESS or FAILED)."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp, code = store.query_task(task_id)
        assert code == 0, code
        if resp.status.name in ("SUCCESS", "FAILED") or time.monotonic() > deadline:
            return resp
        time.sleep(0.05)


def mooncake_tasks_script(store, master: str, config_cls=ReplicateConfig) -> None:
    """Copy, move and their refusals, with the codes a real mooncake_master 0.3.13 answers (two segments)."""
    assert store.setup("localhost", "http://localhost:8080/metadata", 0, 16 << 20, "tcp", "", master) == 0
    both = config_cls()
    both.replica_num = 2
    assert store.put("t/two", b"2" * 4096, both) == 0
    names = sorted(endpoint(r) for r in store.get_replica_desc("t/two"))
    assert len(names) == 2, names
    data = bytes(range(256)) * 64
    assert store.put("t/a", data) == 0
    [src] = [endpoint(r) for r in store.get_replica_desc("t/a")]
    other = next(n for n in names if n != src)
    task, code = store.create_copy_task("t/a", [other])
    assert code == 0 and task != (0, 0) and len(task) == 2
    done = wait_task(store, task)
    assert (done.status.name, done.type.name) == ("SUCCESS", "REPLICA_COPY"), done.message
    assert done.id == task and done.last_updated_at_ms_epoch >= done.created_at_ms_epoch > 0
    assert sorted(endpoint(r) for r in store.get_replica_desc("t/a")) == names
    assert store.get("t/a") == data
    again, code = store.create_copy_task("t/a", [other])  # the target already holds it: success
    assert code == 0 and wait_task(store, again).status.name == "SUCCESS"
    assert len(store.get_replica_desc("t/a")) == 2
    assert store.put("t/m", data[::-1]) == 0
    [msrc] = [endpoint(r) for r in store.get_replica_desc("t/m")]
    mdst = next(n for n in names if n != msrc)
    task, code = store.create_move_task("t/m", msrc, mdst)
    assert code == 0
    done = wait_task(store, task)
    assert (done.status.name, done.type.name) == ("SUCCESS", "REPLICA_MOVE"), done.message
    assert [endpoint(r) for r in store.get_replica_desc("t/m")] == [mdst]
    assert store.get("t/m") == data[::-1]
    assert store.create_copy_task("t/none", [other]) == ((0, 0), -704)  # OBJECT_NOT_FOUND
    assert store.create_copy_task("t/a", []) == ((0, 0), -600)  # INVALID_PARAMS
    assert store.create_copy_task("t/a", ["127.0.0.9:1"]) == ((0, 0), -600)  # not a segment
    assert store.create_move_task("t/m", mdst, mdst) == ((0, 0), -600)
    assert store.create_move_task("t/m", msrc, mdst) == ((0, 0), -600)  # no replica on msrc any more
    assert store.create_move_task("t/none", msrc, mdst) == ((0, 0), -704)
    assert store.query_task((1, 2)) == (None, -1400)  # TASK_NOT_FOUND
    assert store.remove_all(True) == 3
    assert store.close() == 0


def test_tasks_script_runs_on_our_store():
    with store_cluster(nodes=2, segment_size="4MiB") as c:
        mooncake_tasks_script(MooncakeDistributedStore(), c.master)


def test_a_client_segment_runs_the_tasks_of_its_replicas():
    """A client contributing a segment (global_segment_size) is a task's source: its command link copies."""
    with store_cluster(nodes=1, segment_size="4MiB") as c:
        owner = MooncakeDistributedStore()
        assert owner.setup("localhost", "", 2 << 20, 1 << 20, "tcp", "", c.master) == 0
        mine = owner._c.stats()["segment"]
        cfg = ReplicateConfig()
        cfg.preferred_segment = mine
        assert owner.put("c/k", b"k" * 3000, cfg) == 0
        assert [endpoint(r) for r in owner.get_replica_desc("c/k")] == [mine]
        node = next(s["name"] for s in owner._c._rpc.call("status")["segments"] if s["name"] != mine)
        task, code = owner.create_move_task("c/k", mine, node)
        assert code == 0
        done = wait_task(owner, task)
        assert done.status.name == "SUCCESS" and done.assigned_segment == mine, done.message
        assert [endpoint(r) for r in owner.get_replica_desc("c/k")] == [node]
        reader = MooncakeDistributedStore()
        assert reader.setup("localhost", "", 0, 1 << 20, "tcp", "", c.master) == 0
        assert owner.close() == 0  # the moved object no longer needs its old segment
        assert reader.get("c/k") == b"k" * 3000
        assert reader.close() == 0


# ---- the master's side, on a MasterService with a fake clock and segments no process serves --------------------
def _master():
    now = [100.0]
    m = MasterService(MasterConfig(lease_ttl_ms=1000), clock=lambda: now[0])
    names = []
    for i in range(3):
        wire = {"v": 1, "segment_id": f"s{i}", "host_id": "h", "transports": {}, "regions": [[1, 1 << 16, None]]}
        [(code, name)] = m.handle("register_segment", [[wire, 1, 1 << 16]], {})
        names.append(name)
    for name in names[:2]:  # s0 and s1 poll for commands; s2 has no link
        assert m.handle("tier_register", [[name, "", 0, [], ""]], {}) == [[OK, []]]
    return m, now, names


def _put(m, key: str, segment: str) -> None:
    [(code, _)] = m.handle("put_start", [[key, 1000]], {"segment": segment})
    assert code == OK and m.handle("put_commit", [key], {})[0][0] == OK


def test_master_runs_a_copy_through_the_source_node_and_fails_it_on_a_lost_flight():
    m, now, (s0, s1, s2) = _master()
    _put(m, "k", s0)
    [(code, task)] = m.handle("task_create", [["copy", "k", "", [s1, s2]]], {})
    assert code == OK
    [(code, [cmds, descs])] = m.handle("tier_poll", [s0], {})
    assert [c[:2] + c[4:5] for c in cmds] == [["migrate", "k", s1]] and s1 in descs
    assert 0 < cmds[0][8] <= 25000  # start it within its flight's time, minus a margin
    assert m.handle("task_query", [task], {})[0][1][3] == "PROCESSING"
    m.handle("tier_done", [["migrate", "k", True, None, cmds[0][7] + 1]], {"segment": s0})  # another flight's
    assert m.handle("task_query", [task], {})[0][1][3] == "PROCESSING"
    m.handle("tier_done", [["migrate", "k", True, None, cmds[0][7]]], {"segment": s0})  # s1 written: now s2
    [(code, [cmds, _])] = m.handle("tier_poll", [s0], {})
    assert [c[4] for c in cmds] == [s2]
    assert sorted(n for n, _ in m.table.get("k").replicas) == [s0, s1]
    now[0] += 31  # the node never confirms s2: the flight times out
    m.handle("heartbeat", [s0, s1, s2], {})
    m.tick()
    row = m.handle("task_query", [task], {})[0][1]
    assert row[3] == "FAILED" and s2 in row[7]
    assert sorted(n for n, _ in m.table.get("k").replicas) == [s0, s1]  # the finished copy stays


def test_master_move_switches_the_replica_and_frees_the_source_after_the_lease():
    m, now, (s0, s1, _) = _master()
    _put(m, "k", s0)
    used = m.segments.get(s0).used
    m.handle("get", ["k"], {})  # a reader's lease on the s0 bytes
    [(code, task)] = m.handle("task_create", [["move", "k", s0, [s1]]], {})
    [(_, [[cmd], _])] = m.handle("tier_poll", [s0], {})
    m.handle("tier_done", [["migrate", "k", True, None, cmd[7]]], {"segment": s0})
    assert [n for n, _ in m.table.get("k").replicas] == [s1]
    assert m.handle("task_query", [task], {})[0][1][3] == "SUCCESS"
    assert m.segments.get(s0).used == used  # still leased: the old bytes stay valid
    now[0] += 1.5
    m.tick()
    assert m.segments.get(s0).used == 0


@pytest.mark.parametrize(
    "entry, code",
    [
        (["copy", "k", "", []], INVALID),
        (["copy", "nope", "", ["x"]], NOT_FOUND),
        (["copy", "k", "", ["x:1"]], INVALID),
        (["move", "k", "s0", ["s0"]], INVALID),
        (["move", "k", "s1", ["s0"]], INVALID),
    ],
)
def test_master_refuses_tasks_as_mooncake(entry, code):
    m, now, names = _master()
    _put(m, "k", names[0])
    entry = [
        e.replace("s0", names[0]).replace("s1", names[1])
        if isinstance(e, str)
        else [t.replace("s0", names[0]) for t in e]
        for e in entry
    ]
    assert m.handle("task_create", [entry], {})[0][0] == code
    assert m.handle("task_query", [[1, 2]], {}) == [[NOT_FOUND, None]]


def test_master_refuses_a_source_without_a_command_link_and_a_draining_target():
    m, now, (s0, s1, s2) = _master()
    _put(m, "k", s2)  # only on s2, whose process polls no commands
    [(code, why)] = m.handle("task_create", [["copy", "k", "", [s0]]], {})
    assert code == NOT_NOW and "command link" in why
    _put(m, "j", s0)
    assert m.handle("drain", [s1], {}) == [[OK, None]]
    assert m.handle("task_create", [["copy", "j", "", [s1]]], {})[0][0] == NOT_NOW


def test_master_task_waits_for_another_flight_of_its_key():
    from kvplugins.store.master.disk_state import Flight
    from kvplugins.store.master.replica_tasks import WAIT_S

    m, now, (s0, s1, s2) = _master()
    for key in ("k", "j"):
        _put(m, key, s0)
        m.tiering.flights[key] = Flight("offload", m.table.get(key), s0, now[0] + 1000)  # an offload in the air
    [(_, waits)], [(_, stuck)] = (m.handle("task_create", [["copy", k, "", [s1]]], {}) for k in ("k", "j"))
    assert m.handle("task_query", [waits], {})[0][1][3] == "PENDING"
    del m.tiering.flights["k"]  # k's offload ended: its copy starts on the next sweep
    now[0] += 1
    m.handle("heartbeat", [s0, s1, s2], {})
    m.tick()
    assert m.handle("task_query", [waits], {})[0][1][3] == "PROCESSING"
    now[0] += WAIT_S
    m.handle("heartbeat", [s0, s1, s2], {})
    m.tick()
    row = m.handle("task_query", [stuck], {})[0][1]
    assert row[3] == "FAILED" and "busy" in row[7]


def _tick(m, now, names, dt: float) -> None:
    now[0] += dt
    m.handle("heartbeat", list(names), {})
    m.tick()


def test_master_task_allocates_on_its_target_only_and_never_evicts_elsewhere():
    m, now, (s0, s1, s2) = _master()
    for i in range(20):
        _put(m, f"o/{i}", s0)  # the oldest objects of the store, on s0
    full = m.segments.get(s1).allocator
    while full.alloc(4096) is not None:  # s1 full of space no object holds (nothing to evict)
        pass
    _put(m, "k", s0)
    _tick(m, now, (s0, s1, s2), 5)  # everything is past the eviction grace
    [(_, task)] = m.handle("task_create", [["copy", "k", "", [s1]]], {})
    row = m.handle("task_query", [task], {})[0][1]
    assert row[3] == "FAILED" and "no room" in row[7]
    [(_, task)] = m.handle("task_create", [["copy", "k", "", [s2, s1]]], {})  # s2 has room, then s1 drains
    [(_, [[cmd], _])] = m.handle("tier_poll", [s0], {})
    assert m.handle("drain", [s1], {}) == [[OK, None]]
    m.handle("tier_done", [["migrate", "k", True, None, cmd[7]]], {"segment": s0})
    row = m.handle("task_query", [task], {})[0][1]
    assert row[3] == "FAILED" and "draining" in row[7]
    assert m.counters["evictions"] == 0 and len(m.table) == 21


def test_master_late_report_of_an_ended_flight_credits_nothing():
    m, now, (s0, s1, s2) = _master()
    _put(m, "k", s0)
    [(_, first)] = m.handle("task_create", [["copy", "k", "", [s1]]], {})
    [(_, [[old], _])] = m.handle("tier_poll", [s0], {})
    _tick(m, now, (s0, s1, s2), 31)  # its flight times out
    assert m.handle("task_query", [first], {})[0][1][3] == "FAILED"
    [(_, second)] = m.handle("task_create", [["copy", "k", "", [s1]]], {})
    [(_, [[new], _])] = m.handle("tier_poll", [s0], {})
    m.handle("tier_done", [["migrate", "k", True, None, old[7]]], {"segment": s0})  # the first write, late
    assert m.handle("task_query", [second], {})[0][1][3] == "PROCESSING"
    assert [n for n, _ in m.table.get("k").replicas] == [s0]
    m.handle("tier_done", [["migrate", "k", True, None, new[7]]], {"segment": s0})
    assert m.handle("task_query", [second], {})[0][1][3] == "SUCCESS"


def test_master_caps_a_sources_writes_and_expires_commands_of_ended_flights():
    from kvplugins.store.master.disk_state import MAX_FLIGHTS

    m, now, (s0, s1, s2) = _master()
    for i in range(MAX_FLIGHTS + 8):
        _put(m, f"c/{i}", s0)
        assert m.handle("task_create", [["copy", f"c/{i}", "", [s1]]], {})[0][0] == OK
    [(_, [cmds, _])] = m.handle("tier_poll", [s0], {})
    assert len(cmds) == MAX_FLIGHTS  # the rest wait for these
    m.handle("tier_done", [["migrate", c[1], True, None, c[7]] for c in cmds[:4]], {"segment": s0})
    _tick(m, now, (s0, s1, s2), 0.1)
    [(_, [more, _])] = m.handle("tier_poll", [s0], {})
    assert len(more) == 4  # four done, four more started
    m.handle("remove", [more[0][1]], {})  # its flight ends while the command is queued...
    [(_, task)] = m.handle("task_create", [["copy", "c/0", "", [s2]]], {})
    m.handle("tier_done", [["migrate", c[1], True, None, c[7]] for c in more[1:]], {"segment": s0})
    m.tiering.nodes[s0].queue.append(more[0][:8])  # ...and a node polls it (again): TTL 0, never run
    [(_, [again, _])] = m.handle("tier_poll", [s0], {})
    assert [c[8] for c in again if c[1] == more[0][1]] == [0]


def test_master_copy_of_a_source_replica_dropped_meanwhile_fails():
    m, now, (s0, s1, s2) = _master()
    [(code, locs)] = m.handle("put_start", [["k", 1000]], {"replicas": 2, "segment": s0})
    assert code == OK and m.handle("put_commit", ["k"], {"xxh3": [7]})[0][0] == OK
    held = [n for n, _ in m.table.get("k").replicas]
    target = next(n for n in (s1, s2) if n not in held)
    [(_, task)] = m.handle("task_create", [["copy", "k", "", [target]]], {})
    [(src, cmd)] = [(n, c[0]) for n in (s0, s1) for c, _ in [m.handle("tier_poll", [n], {})[0][1]] if c]
    assert m.handle("report_corrupt", [["k", src, cmd[3], 7]], {}) == [[OK, None]]  # a reader found it corrupt
    m.handle("tier_done", [["migrate", "k", True, None, cmd[7]]], {"segment": src})
    row = m.handle("task_query", [task], {})[0][1]
    assert row[3] == "FAILED" and "changed" in row[7]
    assert [n for n, _ in m.table.get("k").replicas] == [n for n in held if n != src]  # nothing copied in
