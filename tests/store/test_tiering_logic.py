"""The master's disk-tier bookkeeping (master/tiering.py, master/drain.py) without processes: the ops a node and
a client would send, driven by hand with a fake clock. Covers the races real-process tests cannot aim at."""

from kvplugins.store.config import MasterConfig
from kvplugins.store.master.service import MasterService
from kvplugins.store.wire.protocol import EXISTS, NOT_FOUND, OK, ON_DISK

OBJ = 64


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def master(high=1.0, low=1.0):
    clock = Clock()
    svc = MasterService(
        MasterConfig(
            lease_ttl_ms=1000,
            put_timeout_ms=2000,
            eviction_grace_ms=0,
            high_watermark=high,
            low_watermark=low,
            alloc_align=64,
        ),
        clock=clock,
    )
    svc.clock_ = clock
    return svc


def node(svc, seg_id="s", size=4 * OBJ, files=(), endpoint="127.0.0.1:1"):
    wire = {"v": 1, "segment_id": seg_id, "host_id": "h", "transports": {}, "regions": [[1, size, None]]}
    [(code, name)] = svc.handle("register_segment", [[wire, 1, size]], {})
    [(code, stale)] = svc.handle("tier_register", [[name, endpoint, 1 << 20, list(files)]], {})
    assert code == OK
    return name, stale


def put(svc, *keys):
    started = svc.handle("put_start", [[k, OBJ] for k in keys], {})
    assert all(code == OK for code, _ in started)
    svc.handle("put_commit", list(keys), {})
    svc.tick()  # the master's sweep (watermarks, tier)


def poll(svc, name):
    [(code, (cmds, _))] = svc.handle("tier_poll", [name], {})
    assert code == OK
    return cmds


def test_sweep_offloads_and_frees_dram_only_after_the_node_confirms():
    svc = master(high=0.6, low=0.3)
    name, _ = node(svc)
    put(svc, "a", "b", "c")  # 75% > high: the sweep picks a and b
    cmds = poll(svc, name)
    assert [c[:2] for c in cmds] == [["offload", "a"], ["offload", "b"]]
    assert svc.segments.get(name).used == 3 * OBJ  # nothing freed before the files are durable
    svc.handle("tier_done", [["offload", "a", True, 11, 0], ["offload", "b", True, 12, 0]], {"segment": name})
    assert svc.segments.get(name).used == OBJ and svc.handle("get", ["a"], {})[0] == [ON_DISK, ["127.0.0.1:1", OBJ]]
    assert svc.op_status([], {}, svc.clock())["offloads"] == 2


def test_urgent_eviction_drops_an_object_in_flight_and_its_late_file_is_deleted():
    svc = master(high=0.6, low=0.3)
    name, _ = node(svc)
    put(svc, "a", "b", "c")
    assert len(poll(svc, name)) == 2  # offloads of a and b in flight
    put(svc, "d", "e")  # e finds it full: evicts a at once (dropped)
    assert svc.handle("exists", ["a", "e"], {}) == [False, True]
    svc.handle("tier_done", [["offload", "a", True, 11, 0]], {"segment": name})
    assert ["delete", "a"] in poll(svc, name)  # nobody wants that file
    assert svc.op_status([], {}, svc.clock())["disk_objects"] == 0


def test_promotion_and_its_races():
    svc = master()
    name, stale = node(svc, files=[["x", OBJ, 7], ["y", OBJ, 8]])
    assert stale == [] and svc.handle("get", ["x"], {})[0][0] == ON_DISK
    [(code, (off, size))] = svc.handle("promote_start", ["x"], {"segment": name})
    assert code == OK and size == OBJ
    assert svc.handle("promote_start", ["x"], {"segment": name})[0][0] == EXISTS  # a second client waits
    svc.handle("promote_commit", [["x", True, None]], {"segment": name})
    [(code, (n, locations, _, checksum))] = svc.handle("get", ["x"], {})
    assert code == OK and locations == [[name, 1, off]] and checksum == 7
    svc.handle("promote_start", ["y"], {"segment": name})
    svc.handle("promote_commit", [["y", False, "corrupt"]], {"segment": name})  # the file failed its check
    assert svc.handle("get", ["y"], {})[0][0] == NOT_FOUND
    assert svc.op_status([], {}, svc.clock())["disk_corrupt"] == 1


def test_removed_key_deletes_its_file_and_a_reput_never_reuses_it():
    svc = master()
    name, _ = node(svc, files=[["k", OBJ, 5]])
    svc.handle("remove", ["k"], {})
    assert ["delete", "k"] in poll(svc, name)
    put(svc, "k")  # same key, new bytes
    assert svc.tiering.copy(svc.table.get("k")) is None  # the old file is no clean copy of the new object


def test_restarted_node_announcing_a_stale_file_is_told_to_delete_it():
    svc = master()
    node(svc, "a")
    put(svc, "k")  # k now lives in DRAM with its own checksum
    svc.table.get("k").checksum = 1
    _, stale = node(svc, "b", files=[["k", OBJ, 2], ["k2", OBJ, 3]])
    assert stale == ["k"] and svc.handle("exists", ["k2"], {}) == [True]


def test_drain_migrates_then_tells_the_node_to_exit():
    svc = master()
    a, _ = node(svc, "a", files=[["disk", OBJ, 9]])
    put(svc, "d1")  # placed on a (the only segment)
    b, _ = node(svc, "b")
    assert svc.handle("drain", [a], {}) == [[OK, None]]
    put(svc, "new")
    assert svc.table.get("new").replicas[0][0] == b  # no new placements on a
    cmds = poll(svc, a)
    assert sorted((c[1], c[3] >= 0, c[4]) for c in cmds) == [("d1", True, b), ("disk", False, b)]
    svc.handle("tier_done", [["migrate", c[1], True, None, c[7]] for c in cmds], {"segment": a})
    assert [r[0] for r in svc.table.get("d1").replicas] == [b] and svc.handle("get", ["disk"], {})[0][0] == OK
    assert ["exit"] in poll(svc, a) + poll(svc, a)  # after the file deletes


def test_a_failing_disk_gets_no_offloads_for_a_while():
    svc = master(high=0.6, low=0.3)
    name, _ = node(svc)
    put(svc, "a", "b", "c")
    svc.handle(
        "tier_done",
        [["offload", c[1], False, "No space left on device", 0] for c in poll(svc, name)],
        {"segment": name},
    )
    put(svc, "d")  # over high again: no offload while the node backs off, and the sweep drops nothing either
    assert poll(svc, name) == [] and svc.op_status([], {}, svc.clock())["offload_failures"] == 2
    assert svc.handle("exists", ["a", "b", "c", "d"], {}) == [True] * 4
    svc.clock_.t += 1.5
    put(svc, "e", "f")  # over high once more: offloaded again
    cmds = poll(svc, name)
    assert cmds and all(c[0] == "offload" for c in cmds)


def test_a_new_master_keeps_sweep_victims_until_it_learns_the_tiers():
    """A leader that took over knows no node's tier until their next poll: for TIER_LEARN_S its sweep keeps the
    victims in DRAM (they were dropped before, found by the cluster runs: issue #34); past it, a node that never
    registered a tier has none, and the sweep evicts as without a disk tier. A master that did not take over
    (test_master_logic) evicts at once."""
    from kvplugins.store.master.tiering import TIER_LEARN_S

    svc = master(high=0.6, low=0.3)
    svc.tiering.took_over(svc.clock())  # what ha/recovery.py's restore does on a takeover
    wire = {"v": 1, "segment_id": "s", "host_id": "h", "transports": {}, "regions": [[1, 4 * OBJ, None]]}
    [(_, name)] = svc.handle("register_segment", [[wire, 1, 4 * OBJ]], {})
    put(svc, "a", "b", "c")  # 75% > high, no tier known yet
    assert svc.handle("exists", ["a", "b", "c"], {}) == [True] * 3
    svc.handle("tier_register", [[name, "127.0.0.1:1", 1 << 20, []]], {})
    svc.tick()
    assert [c[:2] for c in poll(svc, name)] == [["offload", "a"], ["offload", "b"]]  # now the tier takes them

    plain = master(high=0.6, low=0.3)
    plain.tiering.took_over(plain.clock())
    plain.handle("register_segment", [[wire, 1, 4 * OBJ]], {})
    put(plain, "a", "b", "c")
    assert len(plain.table) == 3
    plain.clock_.t += TIER_LEARN_S + 0.1
    plain.tick()  # no tier ever registered: evicted down to the low watermark
    assert len(plain.table) == 1 and plain.op_status([], {}, plain.clock())["evictions"] >= 2


def test_disk_only_objects_stay_out_of_the_eviction_scan():
    svc = master()
    name, _ = node(svc, files=[[f"d/{i}", OBJ, i] for i in range(1000)])
    put(svc, "a")
    assert [o.key for o in svc.table.iter_lru()] == ["a"] and len(svc.table) == 1001 and "d/7" in svc.table
    [(code, (off, _))] = svc.handle("promote_start", ["d/7"], {"segment": name})
    svc.handle("promote_commit", [["d/7", True, None]], {"segment": name})
    assert [o.key for o in svc.table.iter_lru()] == ["a", "d/7"]  # promoted: back in the LRU, newest
    svc.handle("remove", ["d/8"], {})
    assert "d/8" not in svc.table and len(svc.table) == 1000
    svc.clock_.t += 2  # past d/7's lease from the promotion
    assert svc.handle("remove_all", [], {}) == [OK, 1000] and len(svc.table) == 0  # disk-only ones too


def test_a_big_disk_announces_in_chunks():
    svc = master()
    name, _ = node(svc, files=[["a", OBJ, 1]])
    [(code, stale)] = svc.handle("tier_register", [[name, "127.0.0.1:1", 1 << 20, [["b", OBJ, 2]]]], {"more": 1})
    assert code == OK and svc.handle("exists", ["a", "b"], {}) == [True, True]  # the first chunk stays


def test_a_restarted_process_takes_over_its_disk_and_dram_losses_fall_back_to_it():
    svc = master()
    wire = {"v": 1, "segment_id": "old", "host_id": "h", "transports": {}, "regions": [[1, 4 * OBJ, None]]}
    [(_, old)] = svc.handle("register_segment", [[wire, 1, 4 * OBJ]], {})
    svc.handle("tier_register", [[old, "127.0.0.1:1", 1 << 20, [["x", OBJ, 7], ["y", OBJ, 8]], "disk-1"]], {})
    svc.handle("promote_start", ["x"], {"segment": old})
    svc.handle("promote_commit", [["x", True, None]], {"segment": old})  # x: DRAM on old + its file
    wire = {**wire, "segment_id": "new"}
    [(_, new)] = svc.handle("register_segment", [[wire, 1, 4 * OBJ]], {})
    [(code, stale)] = svc.handle(
        "tier_register", [[new, "127.0.0.1:2", 1 << 20, [["x", OBJ, 7], ["y", OBJ, 8]], "disk-1"]], {}
    )
    assert code == OK and stale == []  # same disk: adopted, nothing deleted
    svc.handle("unregister", [old], {})  # the old process's segment leaves
    svc.tick()
    assert [a[0] for a in svc.handle("get", ["x", "y"], {})] == [ON_DISK, ON_DISK]
    assert svc.handle("get", ["x"], {})[0][1][0] == "127.0.0.1:2"


def test_an_object_with_two_replicas_keeps_a_disk_copy_on_each_node_and_survives_losing_one():
    """Replicated disk copies: the sweep offloads a 2-replica object to both replicas' nodes and frees DRAM only
    once both hold their file, so losing one node (its disk with it) leaves the object on the other. A node whose
    write failed gets the missing copy from a later sweep; until then the object stays in DRAM."""
    svc = master(high=0.4, low=0.3)
    a, _ = node(svc, "A", endpoint="127.0.0.1:1")
    b, _ = node(svc, "B", endpoint="127.0.0.1:2")
    started = svc.handle("put_start", [[k, OBJ] for k in ("x", "y", "z")], {"replicas": 2})
    assert all(code == OK and len(locs) == 2 for code, locs in started)
    svc.handle("put_commit", ["x", "y", "z"], {})
    svc.tick()  # 75% of each segment > high: x and y go to disk (z is left: in flight brings it under low)
    for name in (a, b):
        assert [c[:2] for c in poll(svc, name)] == [["offload", "x"], ["offload", "y"]]

    def in_dram(key):  # without a get (a get would touch the LRU)
        return len(svc.table.get(key).replicas)

    svc.handle("tier_done", [["offload", "x", True, 11, 0], ["offload", "y", True, 12, 0]], {"segment": a})
    assert in_dram("x") == 2 and in_dram("y") == 2  # one copy of two: still in DRAM on both
    svc.handle("tier_done", [["offload", "x", True, 11, 0], ["offload", "y", False, "ENOSPC", 0]], {"segment": b})
    assert in_dram("x") == 0 and in_dram("y") == 2
    st = svc.op_status([], {}, svc.clock())
    assert (st["disk_objects"], st["disk_copies"], st["offloads"], st["offload_failures"]) == (2, 3, 1, 1)
    svc.clock_.t += 2.0  # B's back-off over: the next sweep writes y's missing copy to B only
    svc.tick()
    assert [c[:2] for c in poll(svc, b)] == [["offload", "y"]] and poll(svc, a) == []
    svc.handle("tier_done", [["offload", "y", True, 12, 0]], {"segment": b})
    assert svc.handle("get", ["y"], {})[0][0] == ON_DISK
    svc.handle("unregister", [a], {})  # node A and its disk are gone
    svc.tick()
    for key in ("x", "y"):
        assert svc.handle("get", [key], {})[0] == [ON_DISK, ["127.0.0.1:2", OBJ]], key
    assert svc.op_status([], {}, svc.clock())["disk_copies"] == 2


def test_a_new_leader_keeps_disk_only_objects_until_the_tiers_name_their_copies():
    """An object on disk only is journaled with no DRAM replica. A new HA leader restores it with none (the old
    decoder skipped such records): until the nodes' tiers register again the key exists, so a put of it is not
    started anew, and the registration adopts the disk copy instead of deleting it as stale (CI's every-fault
    run lost 6 objects so: a put started after a takeover, its leader killed, the copies deleted). One that no
    tier names within TIER_LEARN_S is dropped."""
    from kvplugins.store.master.ha.journal import decode_object, encode_object
    from kvplugins.store.master.ha.recovery import restore
    from kvplugins.store.master.tiering import TIER_LEARN_S

    old = master()
    name, _ = node(old, "a", files=[["k", OBJ, 5], ["gone", OBJ, 6]])
    records = [(key, *decode_object(encode_object(old.table.get(key)))) for key in ("k", "gone")]
    assert [r[2] for r in records] == [[], []]  # no DRAM replica
    new = master()
    seg = old.segments.get(name)
    assert restore(new, [(name, seg.descriptor, seg.region_id, seg.size)], records, new.clock())["disk_only"] == 2
    assert new.handle("exists", ["k", "gone"], {}) == [True, True]
    assert new.handle("put_start", [["k", OBJ]], {})[0][0] == EXISTS  # not started anew meanwhile
    [(code, stale)] = new.handle("tier_register", [[name, "127.0.0.1:1", 1 << 20, [["k", OBJ, 5]]]], {})
    assert code == OK and stale == []  # the copy is adopted, not deleted
    assert new.handle("get", ["k"], {})[0] == [ON_DISK, ["127.0.0.1:1", OBJ]]
    new.clock_.t += TIER_LEARN_S + 0.1
    new.tick()
    assert new.handle("exists", ["k", "gone"], {}) == [True, False]  # no tier named gone's copy
