"""One round trip per put (client-reserved slabs, store/master/slabs.py and store/client/slab.py): the master's
bookkeeping with a fake clock, then real processes: a put is one RPC and visible to another client at once, a
slab on a killed node falls back to put_start, concurrent puts share the slab safely."""

import itertools
import threading

import numpy as np
import pytest

from helpers.cluster import store_cluster
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.client.slab import slab_offsets
from kvplugins.transfer.spans import SMALL
from kvplugins.store.master.disk_state import Frozen
from kvplugins.store.wire.protocol import EXISTS, EXPIRED, INVALID, OK, STORE_FULL
from test_master_logic import service, wire

MiB = 1 << 20


def reg(m, name="s", size=128 * MiB):
    [(code, seg)] = m.handle("register_segment", [[wire(name, size), 1, size]], {})
    assert code == OK
    return m.segments.get(seg)


def reserve(m, want=4 * MiB, release=()):
    [(code, value)] = m.handle("reserve", [want], {"release": list(release)})
    assert code == OK, value
    return value


def test_reserve_is_capped_and_small_pools_offer_none():
    m = service()
    reg(m, size=32 * MiB)
    [(code, why)] = m.handle("reserve", [4 * MiB], {})
    assert code == INVALID and "use put_start" in why
    big = reg(m, "b", 128 * MiB)
    sid, seg, region, off, length, ttl, align = reserve(m, 16 * MiB)
    assert (seg, length, ttl, align) == (big.name, 2 * MiB, 2000, 64)  # 1/64 of the largest segment
    assert big.allocator.used_bytes == 2 * MiB


def test_puts_carve_objects_from_the_slab_front():
    m = service()
    seg = reg(m)
    sid, name, region, off, length, *_ = reserve(m)
    assert m.handle("put", [["a", 100, sid, off], ["b", 64, sid, off + 128]], {"xxh3": [7, 8]}) == [[OK, None]] * 2
    [(code, (size, locs, _, xxh))] = m.handle("get", ["a"], {})
    assert (code, size, locs, xxh) == (OK, 100, [[name, region, off]], 7)
    # a back-to-back batch is carved in one pass: the same allocations as one split per object
    assert [seg.allocator.size_at(o) for o in (off, off + 128, off + 192)] == [128, 64, length - 192]
    assert m.handle("put", [["a", 100, sid, off + 192]], {}) == [[EXISTS, "complete"]]  # nothing carved
    [(code, why)] = m.handle("put", [["c", 64, sid, off]], {})  # behind the front
    assert code == INVALID and "front" in why
    [(code, _)] = m.handle("put", [["c", 64, sid, off + length - 32]], {})  # overruns the slab
    assert code == INVALID
    assert m.handle("put", [["c", 64, sid, off + 1024]], {}) == [[OK, None]]  # skips a gap ...
    assert seg.allocator.used_bytes == length - (1024 - 192)  # ... freed at once
    # a key repeated in one batch: the first is stored, the second is the same key (EXISTS); a None checksum is none
    d = off + 1024 + 64
    assert m.handle("put", [["d", 64, sid, d], ["d", 64, sid, d + 64]], {"xxh3": [None, 5]}) == [
        [OK, None],
        [EXISTS, "complete"],
    ]
    [(code, (_, locs, _, xxh))] = m.handle("get", ["d"], {})
    assert (code, locs, xxh) == (OK, [[name, region, d]], None)
    e = d + 64  # the slab's front: a run of two, one checksum unknown
    assert m.handle("put", [["e", 64, sid, e], ["f", 64, sid, e + 64]], {"xxh3": [None, 9]}) == [[OK, None]] * 2
    assert [a[1][3] for a in m.handle("get", ["e", "f"], {})] == [None, 9]
    m.handle("remove", ["a", "b", "c", "d", "e", "f"], {})
    m.clock_.t += 1.1  # past every lease
    m.tick()
    assert seg.allocator.used_bytes == length - 1024 - 256  # only the remainder
    reserve(m, release=[sid])  # given back
    assert seg.allocator.used_bytes == length
    assert seg.allocator.free_blocks() == 1  # all freed space coalesced; the new slab at its start


def test_expired_unknown_and_draining_slabs_answer_expired():
    m = service()
    seg = reg(m)
    sid, _, _, off, *_ = reserve(m)
    assert m.handle("put", [["x", 64, sid + 99, off]], {})[0][0] == EXPIRED
    advance(m, seg, 1.9)
    assert m.handle("put", [["x", 64, sid, off]], {}) == [[OK, None]]  # renews the slab's 2 s lease
    advance(m, seg, 1.9)
    assert m.handle("put", [["y", 64, sid, off + 64]], {}) == [[OK, None]]
    advance(m, seg, 2.1)
    assert m.handle("put", [["z", 64, sid, off + 128]], {})[0][0] == EXPIRED
    m.tick()
    assert seg.allocator.used_bytes == 128 and len(m.slabs) == 0  # remainder freed
    sid = reserve(m)[0]
    seg.allocator = Frozen(seg.allocator)  # the segment is draining
    assert m.handle("put", [["z", 64, sid, 0]], {})[0][0] == EXPIRED
    m.tick()
    assert len(m.slabs) == 0


def test_a_slab_never_evicts_a_live_object():
    m = service()
    seg = reg(m, size=64 * MiB)
    assert m.handle("put_start", [["old", 64 * MiB - 64]], {})[0][0] == OK
    m.handle("put_commit", ["old"], {})  # evictable, but a slab may not
    [(code, why)] = m.handle("reserve", [MiB], {})
    assert code == STORE_FULL and "put_start" in why
    assert m.handle("exists", ["old"], {}) == [True] and seg.allocator.used_bytes == 64 * MiB - 64


def advance(m, seg, seconds):
    m.clock_.t += seconds
    m.handle("heartbeat", [seg.name], {})  # the segment stays registered


def test_a_put_over_the_watermark_frees_due_space_before_evicting():
    """Removed objects whose lease ended still count as used until the sweep frees them; a put that crosses
    the high watermark must free them, not evict the object it just stored (store_bench lost a fresh key)."""
    m = service(high=0.5, low=0.4)
    seg = reg(m, size=64 * MiB)
    sid, _, _, off, *_ = reserve(m, MiB)  # the writer's slab, held
    assert m.handle("put_start", [["old", 40 * MiB]], {})[0][0] == OK
    m.handle("put_commit", ["old"], {})
    m.handle("get", ["old"], {})  # leased for 1 s
    m.handle("remove", ["old"], {})  # a zombie until then
    advance(m, seg, 1.1)  # due, no sweep yet
    assert m.handle("put", [["new", 4096, sid, off]], {}) == [[OK, None]]
    assert m.handle("exists", ["new"], {}) == [True] and m.counters["evictions"] == 0


def _counting(client):
    """The master ops ``client`` sends from now on, in order (its one-call native ops too: one round trip each)."""
    ops, real, held = [], client._rpc.call, client._rpc.held
    client._rpc.call = lambda op, *a, **k: (ops.append(op), real(op, *a, **k))[1]
    client._rpc.held = lambda op, *a, **k: (ops.append(op), held(op, *a, **k))[1]
    return ops


def test_a_put_is_one_round_trip_and_visible_to_another_client_at_once():
    with (
        store_cluster(nodes=1, segment_size="128MiB") as c,
        StoreClient(ClientConfig(master=c.master)) as writer,
        StoreClient(ClientConfig(master=c.master)) as reader,
    ):
        writer.put("warm", b"w")  # reserves the slab
        ops = _counting(writer)
        for i in range(20):
            writer.put(f"k/{i}", bytes([i]) * (1000 + i))
            assert reader.get(f"k/{i}") == bytes([i]) * (1000 + i)  # read-after-put, other client
        assert writer.batch_put([f"b/{i}" for i in range(64)], [b"x" * 4096] * 64) == [None] * 64
        assert ops == ["put"] * 21
        assert reader.batch_get([f"b/{i}" for i in range(64)]) == [b"x" * 4096] * 64
        assert writer._rpc.call("status")["slabs"] == 1


@pytest.mark.parametrize("transports", ["shm,tcp", "tcp"])
def test_a_slab_on_a_killed_node_falls_back_to_put_start(transports):
    with (
        store_cluster(nodes=2, segment_size="128MiB", node_flags={"transports": transports}) as c,
        StoreClient(ClientConfig(master=c.master, transports=transports, transfer_timeout_ms=2000)) as client,
    ):
        client.put("warm", b"w")
        [(_, (_, [[slab_seg, _, _]], _, _))] = client._rpc.call("get", ["warm"])
        victim = next(n for n in c.nodes if n.address == slab_seg)
        victim.kill()
        ops = _counting(client)
        client.put("after", b"a" * 5000)  # the slab's node is dead
        assert client.get("after") == b"a" * 5000
        [(_, (_, [[seg, _, _]], _, _))] = client._rpc.call("get", ["after"])
        assert seg != slab_seg  # stored on the live node
        # off the dead slab: put_start (the general path's write into the slab failed), or a new slab (the native
        # TCP write failed first, forgot the slab, and the general path reserved another)
        assert "put_start" in ops or "reserve" in ops


def test_concurrent_puts_share_the_slab_and_read_back_exact():
    with store_cluster(nodes=1, segment_size="128MiB") as c, StoreClient(ClientConfig(master=c.master)) as client:
        errors = []

        def work(t):
            for i in range(40):
                keys = [f"t{t}/{i}/{j}" for j in range(4)]
                got = client.batch_put(keys, [f"{k}".encode() * 50 for k in keys])
                errors.extend(e for e in got if e is not None)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == []
        keys = [f"t{t}/{i}/{j}" for t in range(4) for i in range(40) for j in range(4)]
        assert client.batch_get(keys) == [k.encode() * 50 for k in keys]


@pytest.mark.parametrize(
    "sizes,align", [([4096] * 128, 64), ([1, 64, 65, 4096, 3, 1 << 20], 64), ([100] * 5, 4096), ([7, 7, 8], 1)]
)
def test_a_batch_is_laid_out_back_to_back_each_object_rounded_up(sizes, align):
    front = 3 * align
    offsets, end = slab_offsets(sizes, front, align)
    want = list(itertools.accumulate([-(-n // align) * align for n in sizes], initial=front))
    assert list(map(int, offsets)) == want[:-1] and end == want[-1]
    assert type(offsets) is list if len(sizes) <= SMALL else offsets.dtype == np.uint64  # the native calls' forms
