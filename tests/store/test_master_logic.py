"""MasterService without processes: put/commit/get, leases, LRU eviction, watermarks, reclaim, lost segments.
A fake clock drives time."""

import pytest

from kvplugins.store.config import MasterConfig
from kvplugins.store.master.service import EVICT_PER_CALL, MasterService
from kvplugins.store.wire.protocol import EXISTS, EXPIRED, NOT_FOUND, OK, STORE_FULL


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def wire(seg_id, size):
    return {"v": 1, "segment_id": seg_id, "host_id": "h", "transports": {}, "regions": [[1, size, None]]}


def service(high=0.9, low=0.5):
    clock = Clock()
    # grace 0: these tests are about LRU order and leases; the grace has its own (tests/store/test_churn.py)
    svc = MasterService(
        MasterConfig(
            lease_ttl_ms=1000,
            put_timeout_ms=2000,
            heartbeat_timeout_ms=3000,
            eviction_grace_ms=0,
            high_watermark=high,
            low_watermark=low,
            alloc_align=64,
        ),
        clock=clock,
    )
    svc.clock_ = clock
    return svc


@pytest.fixture
def m():
    return service()


def reg(m, seg_id="s", size=640):
    [(code, name)] = m.handle("register_segment", [[wire(seg_id, size), 1, size]], {})
    assert code == OK
    return name


def put(m, key, size=64):
    [(code, val)] = m.handle("put_start", [[key, size]], {})
    if code == OK:
        assert m.handle("put_commit", [key], {}) == [[OK, None]]
    return code


def test_put_get_roundtrip_and_exists_prefix(m):
    name = reg(m)
    [(code, locs)] = m.handle("put_start", [["a", 100]], {})
    assert code == OK and locs[0][0] == name and locs[0][1] == 1
    assert m.handle("get", ["a"], {}) == [[NOT_FOUND, None]]  # pending is invisible
    assert m.handle("exists", ["a"], {}) == [False]
    m.handle("put_commit", ["a"], {})
    [(code, (size, locs2, ttl, xxh))] = m.handle("get", ["a"], {})
    assert (code, size, locs2, ttl, xxh) == (OK, 100, locs, 1000, None)  # committed without a checksum
    put(m, "b")
    assert m.handle("exists_prefix", ["a", "b", "c", "a"], {}) == 2
    assert m.handle("put_start", [["a", 100]], {}) == [[EXISTS, "complete"]]


def test_lru_eviction_on_demand_skips_leased():
    m = service(high=1.0, low=1.0)  # no watermark sweep: only on-demand eviction
    reg(m, size=64 * 4)
    for k in "abcd":
        assert put(m, k) == OK
    m.handle("get", ["a"], {})  # a leased and most recent; b is now LRU
    assert put(m, "e") == OK
    assert m.handle("exists", list("abcde"), {}) == [True, False, True, True, True]
    for k in "cde":
        m.handle("get", [k], {})  # everything leased now
    [(code, msg)] = m.handle("put_start", [["f", 64]], {})
    assert code == STORE_FULL and "leased" in msg
    m.clock_.t += 1.5  # leases expire
    assert put(m, "f") == OK


def test_watermark_sweep_evicts_down_to_low(m):
    reg(m, size=64 * 10)
    for i in range(9):
        put(m, f"k{i}")
    m.tick()  # 9/10 = 0.9, not above high
    assert m.handle("status", [], {})["evictions"] == 0
    put(m, "k9")  # 10/10 > 0.9 -> evict to <= 0.5
    st = m.handle("status", [], {})
    assert st["evictions"] == 5 and st["bytes_used"] == 64 * 5
    assert m.handle("exists", [f"k{i}" for i in range(10)], {}) == [False] * 5 + [True] * 5


def test_pending_reclaimed_and_late_commit_expires(m):
    reg(m, size=128)
    m.handle("put_start", [["p", 128]], {})
    m.clock_.t += 2.5
    m.tick()
    assert m.handle("put_commit", ["p"], {})[0][0] == EXPIRED
    assert put(m, "q", 128) == OK


def test_a_commit_sent_again_after_its_reply_was_lost_is_ok_only_for_the_same_bytes(m):
    """The follower resends put_commit to a leader whose connection failed after sending: the first commit was
    applied, so the second finds the object complete. Same checksum: OK (the put is done); another checksum or
    none: EXPIRED (not this put's bytes, or unknown)."""
    reg(m)
    m.handle("put_start", [["a", 64]], {})
    assert m.handle("put_commit", ["a"], {"xxh3": [7]}) == [[OK, None]]
    assert m.handle("put_commit", ["a"], {"xxh3": [7]}) == [[OK, None]]
    assert m.handle("put_commit", ["a"], {"xxh3": [8]})[0][0] == EXPIRED
    assert m.handle("put_commit", ["a"], {})[0][0] == EXPIRED
    assert m.handle("status", [], {})["commits"] == 1
    assert m.handle("get", ["a"], {})[0][1][3] == 7


def test_removed_leased_object_space_freed_after_lease(m):
    reg(m, size=128)
    put(m, "a", 128)
    m.handle("get", ["a"], {})
    assert m.handle("remove", ["a"], {}) == [[OK, None]]
    assert m.handle("exists", ["a"], {}) == [False]
    assert m.handle("put_start", [["b", 128]], {})[0][0] == STORE_FULL  # space still held by the reader
    m.clock_.t += 1.1
    m.tick()
    assert put(m, "b", 128) == OK


def test_space_whose_lease_ended_is_reused_before_the_next_sweep(m):
    reg(m, size=128)
    put(m, "a", 128)
    m.handle("get", ["a"], {})
    m.handle("remove", ["a"], {})
    m.clock_.t += 0.9
    assert m.handle("put_start", [["b", 128]], {})[0][0] == STORE_FULL  # lease still running
    m.clock_.t += 0.2  # lease over, no tick() yet
    assert put(m, "b", 128) == OK


def test_segment_timeout_loses_objects(m):
    s1, s2 = reg(m, "s1"), reg(m, "s2")
    put(m, "a")
    put(m, "b")
    m.clock_.t += 2
    m.handle("heartbeat", [s2], {})
    m.clock_.t += 2
    m.tick()  # s1 silent for 4 s > 3 s: suspect (tests/store/test_liveness.py)
    assert [s["suspect"] for s in m.handle("status", [], {})["segments"]] == [True, False]
    m.clock_.t += 30
    m.handle("heartbeat", [s2], {})
    m.tick()  # silent for 34 s > 3 s + the 30 s suspect grace: removed
    st = m.handle("status", [], {})
    assert [s["name"] for s in st["segments"]] == [s2]
    assert st["objects"] + st["objects_lost"] == 2 and st["objects_lost"] >= 1
    assert m.handle("heartbeat", [s1], {}) == [[NOT_FOUND, None]]


def test_replicas_on_distinct_segments(m):
    reg(m, "s1")
    reg(m, "s2")
    [(code, locs)] = m.handle("put_start", [["r", 64]], {"replicas": 2})
    assert code == OK and len({l[0] for l in locs}) == 2


def test_bad_entries_refuse_the_whole_op_naming_the_field(m):
    reg(m)
    with pytest.raises(ValueError, match=r"put_start: entries: Expected `int` >= 1 - at `\$\[1\]\[1\]`"):
        m.handle("put_start", [["ok", 64], ["x", -1]], {})
    assert m.handle("exists", ["ok"], {}) == [False]  # nothing of the refused batch was applied
    with pytest.raises(ValueError, match=r"register_segment: .* at `\$\[0\]`"):
        m.handle("register_segment", [["nope"]], {})
    with pytest.raises(ValueError, match="unknown op 'frobnicate'"):
        m.handle("frobnicate", [], {})


def test_object_larger_than_any_segment_is_store_full(m):
    reg(m, size=128)
    [(code, msg)] = m.handle("put_start", [["big", 4096]], {})
    assert code == STORE_FULL and "larger" in msg


def test_a_watermark_descent_is_spread_over_ops_and_the_lru_end_goes_first():
    """Past the high watermark an op evicts at most EVICT_PER_CALL objects plus two per object it stored (a
    descent of a tenth of a big segment in one op stalled the master: 25 ms per 1,600 4 KiB objects); the next
    ops and sweeps go on down to the low watermark, least recently used first."""
    m = service(high=0.9, low=0.5)
    reg(m, size=64 * 1000)
    for i in range(900):
        put(m, f"k{i}")
    assert m.handle("status", [], {})["evictions"] == 0
    put(m, "k900")  # 901/1000 > 0.9
    assert m.handle("status", [], {})["evictions"] == EVICT_PER_CALL + 2
    ticks = 0
    while m.handle("status", [], {})["bytes_used"] > 64 * 500:
        m.tick()
        ticks += 1
        assert ticks < 10
    st = m.handle("status", [], {})
    assert ticks >= 2 and st["evictions"] == 401 and st["bytes_used"] == 64 * 500
    assert m.handle("exists", [f"k{i}" for i in range(901)], {}) == [False] * 401 + [True] * 500


def test_a_segment_of_young_objects_is_not_rescanned_by_every_op():
    """Over the high watermark with every object within the eviction grace, the sweep scans the LRU lists once
    and then not again until the first object leaves the grace (it visited every object on every put: 10 ms
    per put at 16 k objects); then it evicts."""
    clock = Clock()
    cfg = MasterConfig(lease_ttl_ms=1000, put_timeout_ms=2000, eviction_grace_ms=1000, high_watermark=0.9,
                       low_watermark=0.5, alloc_align=64)  # fmt: skip
    m = MasterService(cfg, clock=clock)
    reg(m, size=64 * 100)
    scans = []
    real = m.table.iter_lru
    m.table.iter_lru = lambda: (scans.append(clock.t), real())[1]
    for i in range(95):
        put(m, f"k{i}")
        clock.t += 0.001
    assert scans and m.handle("status", [], {})["evictions"] == 0  # over high at k90: scanned, all young
    first = len(scans)
    for i in range(95, 99):
        put(m, f"k{i}")
        m.tick()
    assert len(scans) == first  # nothing evictable before k0 leaves the grace: no scan
    clock.t = 1000.0 + 1.0 + 0.0005  # k0 (born at 1000.0) is past the 1 s grace
    m.tick()
    assert len(scans) > first and m.handle("status", [], {})["evictions"] >= 1
    assert m.handle("exists", ["k0"], {}) == [False]


def test_a_full_pool_of_young_objects_answers_store_full_without_a_scan_per_put():
    """Every object within the grace: the first put that needs space scans once and answers STORE_FULL; the
    next puts answer the same reason without scanning again until the first object leaves the grace (a full
    scan per failing put stalled the master); then a put evicts it and lands."""
    clock = Clock()
    cfg = MasterConfig(lease_ttl_ms=1000, put_timeout_ms=2000, eviction_grace_ms=1000, high_watermark=1.0,
                       low_watermark=1.0, alloc_align=64)  # fmt: skip
    m = MasterService(cfg, clock=clock)
    reg(m, size=64 * 10)
    for i in range(10):
        assert put(m, f"k{i}") == OK
        clock.t += 0.001
    scans = []
    real = m.table.iter_lru
    m.table.iter_lru = lambda: (scans.append(clock.t), real())[1]
    [(code, why)] = m.handle("put_start", [["x0", 64]], {})
    assert code == STORE_FULL and "within the eviction grace" in why and scans
    first = len(scans)
    for i in range(1, 20):
        [(code, again)] = m.handle("put_start", [[f"x{i}", 64]], {})
        assert code == STORE_FULL and again == why
    assert len(scans) == first
    clock.t = 1000.0 + 1.0 + 0.0005  # k0 leaves the grace
    assert put(m, "late") == OK and len(scans) > first
    assert m.handle("exists", ["k0", "late"], {}) == [False, True]
