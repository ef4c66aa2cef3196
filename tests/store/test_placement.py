"""Placement per put (store/placement.py PutConfig): preferred segment, replicas on distinct hosts first, soft and
hard pins. Master logic with a fake clock, then real processes through StoreClient."""

import numpy as np
import pytest

from helpers.cluster import store_cluster
from kvplugins.errors import ConfigError
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.config import MasterConfig
from kvplugins.store.master.service import MasterService
from kvplugins.store.placement import PutConfig
from kvplugins.store.wire.protocol import OK, STORE_FULL

OBJ = 64


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def service():
    svc = MasterService(
        MasterConfig(
            lease_ttl_ms=1000,
            eviction_grace_ms=0,
            high_watermark=1.0,
            low_watermark=1.0,
            alloc_align=64,
            heartbeat_timeout_ms=60_000,
        ),
        clock=Clock(),
    )
    return svc


def reg(m, seg_id, size=OBJ * 4, host="h"):
    wire = {"v": 1, "segment_id": seg_id, "host_id": host, "transports": {}, "regions": [[1, size, None]]}
    [(code, name)] = m.handle("register_segment", [[wire, 1, size]], {})
    assert code == OK
    return name


def put(m, keys, **cfg):
    started = m.handle("put_start", [[k, OBJ] for k in keys], PutConfig(**cfg).wire)
    ok = [k for k, (code, _) in zip(keys, started) if code == OK]
    assert m.handle("put_commit", ok, {}) == [[OK, None]] * len(ok)
    return started


def segs_of(m, key):
    return [loc[0] for loc in m.handle("get", [key], {})[0][1][1]]


def test_preferred_segment_gets_first_replica_single_and_batch():
    m = service()
    a, b = reg(m, "a", OBJ * 5), reg(m, "b", OBJ * 16)  # b has more free space: the default choice
    put(m, ["x"])
    assert segs_of(m, "x") == [b]
    put(m, ["y"], preferred_segment=a)
    put(m, ["z0", "z1", "z2"], preferred_segment=a)  # the batch fast path honours it too
    put(m, ["r"], preferred_segment=a, replicas=2)
    assert [segs_of(m, k)[0] for k in ("y", "z0", "z1", "z2", "r")] == [a] * 5
    assert segs_of(m, "r") == [a, b]
    put(m, ["u"], preferred_segment="no-such:1")  # unknown: the usual order
    assert segs_of(m, "u") == [b]
    put(m, [f"f{i}" for i in range(3)], preferred_segment=a)  # a is full now: falls back to b
    assert {segs_of(m, f"f{i}")[0] for i in range(3)} == {b}


def test_replicas_on_distinct_hosts_first():
    m = service()
    a1, a2 = reg(m, "a1", OBJ * 20, host="A"), reg(m, "a2", OBJ * 19, host="A")
    b1 = reg(m, "b1", OBJ * 4, host="B")  # the least free: last in the default order
    put(m, ["k"], replicas=2)
    assert sorted(segs_of(m, "k")) == sorted([a1, b1])  # not a1 + a2 (same host)
    put(m, ["k3"], replicas=3)
    assert sorted(segs_of(m, "k3")) == sorted([a1, a2, b1])
    put(m, ["k9"], replicas=9)  # more than segments: one per segment
    assert len(segs_of(m, "k9")) == 3


def test_soft_pin_evicted_after_unpinned_until_ttl():
    m = service()
    reg(m, "s", OBJ * 4)
    put(m, ["soft0", "soft1"], pin="soft", pin_ttl_ms=5000)  # the oldest objects, but pinned
    put(m, ["p0", "p1"])
    put(m, ["n0"])  # full: evicts the LRU unpinned p0
    assert m.handle("exists", ["soft0", "soft1", "p0", "p1", "n0"], {}) == [True, True, False, True, True]
    m.handle("get", ["p1", "n0"], {})  # leased: no unpinned victim is left
    put(m, ["n1"])  # so the LRU soft pin goes
    assert m.handle("exists", ["soft0", "soft1", "p1", "n0", "n1"], {}) == [False, True, True, True, True]
    m.clock.t += 6
    m.tick()  # TTL over: soft1 rejoins the LRU as newest
    assert m.table.get("soft1").pin == 0
    put(m, ["n2", "n3", "n4"])  # p1, n0, n1 (older) go first
    assert m.handle("exists", ["soft1", "p1", "n0", "n1"], {}) == [True, False, False, False]
    put(m, ["n5"])
    assert m.handle("exists", ["soft1"], {}) == [False]


def test_hard_pin_never_evicted_and_named_in_store_full():
    m = service()
    reg(m, "s", OBJ * 4)
    put(m, ["h0", "h1", "h2"], pin="hard")
    put(m, ["a"])
    for i in range(5):  # only the unpinned slot turns over
        put(m, [f"b{i}"])
    assert m.handle("exists", ["h0", "h1", "h2", "b4"], {}) == [True] * 4
    assert m.handle("status", [], {})["pinned"] == 3
    m.handle("get", ["b4"], {})  # leased: nothing evictable is left
    [(code, msg)] = m.handle("put_start", [["c", OBJ]], {})
    assert code == STORE_FULL and "3 hard-pinned objects of 192 bytes" in msg
    assert m.handle("remove", ["h0"], {}) == [[OK, None]]  # remove still works on a pinned object
    assert m.handle("put_start", [["c", OBJ]], {})[0][0] == OK


def test_watermark_sweep_skips_hard_pins():
    m = MasterService(
        MasterConfig(high_watermark=0.5, low_watermark=0.25, alloc_align=64, eviction_grace_ms=0), clock=Clock()
    )
    reg(m, "s", OBJ * 8)
    put(m, [f"h{i}" for i in range(4)], pin="hard")
    put(m, ["a", "b"])  # 6/8 > 0.5: the sweep sheds only a and b
    m.tick()
    assert m.handle("exists", [f"h{i}" for i in range(4)] + ["a", "b"], {}) == [True] * 4 + [False] * 2


def test_bad_put_config_is_a_clear_error():
    with pytest.raises(ConfigError, match="pin='sticky'"):
        PutConfig(pin="sticky")
    with pytest.raises(ConfigError, match="replicas=0"):
        PutConfig(replicas=0)
    with pytest.raises(ConfigError, match="pin_ttl_ms"):
        ClientConfig(pin="soft", pin_ttl_ms=0)
    m = service()
    with pytest.raises(ValueError, match=r"put_start: opts: Invalid enum value 7 - at `\$.pin`"):
        m.handle("put_start", [["k", 1]], {"pin": 7})
    with pytest.raises(ValueError, match="soft pin .* needs pin_ttl_ms > 0"):
        m.handle("put_start", [["k", 1]], {"pin": 1})


def test_put_config_per_call_on_real_processes():
    flags = {"high_watermark": 1.0, "low_watermark": 1.0, "eviction_grace_ms": 0}  # on-demand LRU order
    with (
        store_cluster(nodes=2, segment_size="1MiB", master_flags=flags) as c,
        StoreClient(ClientConfig(master=c.master, pin="soft")) as client,
    ):
        size, target = 128 << 10, c.nodes[1].address
        data = np.random.default_rng(3).integers(0, 256, 8 * size, dtype=np.uint8)
        base = client.register_buffer(data).addr
        hard = PutConfig(pin="hard", preferred_segment=target)
        keys = [f"pin/{i}" for i in range(8)]
        assert client.batch_put_from(keys, [[(base + i * size, size)] for i in range(8)], hard) == [None] * 8
        status = {s["name"]: s["objects"] for s in client._rpc.call("status")["segments"]}
        assert status[target] == 8  # preferred: the whole batch on node 1
        for i in range(24):  # 3x the other node: churn, defaults (soft)
            client.put(f"churn/{i}", bytes([i]) * size)
        client.put("big", b"x" * (900 << 10), PutConfig(preferred_segment=target))  # evicts soft pins only
        client.put("one", b"1" * 1000, PutConfig(preferred_segment=target))  # full of hard pins: elsewhere
        assert client.get("big") == b"x" * (900 << 10)
        assert client._rpc.call("get", ["one"])[0][1][1][0][0] == c.nodes[0].address
        out = np.zeros_like(data)
        addr = client.register_buffer(out).addr
        assert client.batch_get_into(keys, [[(addr + i * size, size)] for i in range(8)]) == [None] * 8
        assert np.array_equal(out, data)
