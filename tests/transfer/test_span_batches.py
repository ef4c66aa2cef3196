"""The array form (write_spans/read_spans) against a real peer process, for every transport: exact bytes for
the small (int list) and the numpy path, coalescing of contiguous spans (also across a local region border,
which must not merge), spans bigger than a TCP frame, and per-span errors next to successful spans."""

import numpy as np
import pytest
import xxhash

from helpers.peer import digest
from kvplugins.errors import OutOfRange

BASE = 74 << 20  # this module's own peer; stay clear of offsets other tests in it use


def _roundtrip(engine, peer, src, addrs, roffs, lens, dst_addrs):
    assert engine.write_spans(peer.descriptor, peer.region_id, addrs, roffs, lens) == [None] * len(lens)
    for a, r, n in zip(np.asarray(addrs).tolist(), np.asarray(roffs).tolist(), np.asarray(lens).tolist()):
        off = a - src.ctypes.data
        assert peer.digest(r, n) == digest(src[off : off + n])
    assert engine.read_spans(peer.descriptor, peer.region_id, dst_addrs, roffs, lens) == [None] * len(lens)


@pytest.mark.parametrize("form", ["list", "numpy"])
@pytest.mark.parametrize("count", [1, 5, 200])
def test_spans_write_then_read_exact_bytes(engine, peer, form, count):
    rng = np.random.default_rng(count)
    lens = rng.integers(1, 9000, size=count)
    src = np.frombuffer(rng.bytes(int(lens.sum()) + 64), dtype=np.uint8)
    dst = np.zeros_like(src)
    engine.register(src), engine.register(dst)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) + 3  # contiguous locally
    gaps = rng.integers(0, 2, size=count) * 64  # remote: some adjacent, some not
    roffs = BASE + np.concatenate([[0], np.cumsum(lens + gaps)[:-1]])
    addrs, dst_addrs = src.ctypes.data + starts, dst.ctypes.data + starts
    if form == "list":
        addrs, roffs, lens, dst_addrs = addrs.tolist(), roffs.tolist(), lens.tolist(), dst_addrs.tolist()
    _roundtrip(engine, peer, src, addrs, roffs, lens, dst_addrs)
    n = int(np.sum(lens))
    assert np.array_equal(dst[3 : 3 + n], src[3 : 3 + n])
    assert not dst[:3].any() and not dst[3 + n :].any()  # nothing outside the spans


def test_spans_do_not_merge_across_local_regions(engine, peer):
    src = np.frombuffer(np.random.default_rng(1).bytes(8192), dtype=np.uint8)
    engine.register(src[:4096]), engine.register(src[4096:])  # adjacent, two regions
    dst = np.zeros(8192, dtype=np.uint8)
    engine.register(dst)
    a = src.ctypes.data
    _roundtrip(
        engine, peer, src, [a, a + 4096], [BASE, BASE + 4096], [4096, 4096], [dst.ctypes.data, dst.ctypes.data + 4096]
    )
    assert np.array_equal(dst, src)


def test_span_larger_than_a_frame(engine, peer):
    n = (20 << 20) + 11  # > default max_frame (16 MiB)
    src = np.frombuffer(np.random.default_rng(2).bytes(n), dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    engine.register(src), engine.register(dst)
    _roundtrip(
        engine, peer, src, np.array([src.ctypes.data]), np.array([40 << 20]), np.array([n]), np.array([dst.ctypes.data])
    )
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("form", ["list", "numpy"])
def test_bad_spans_fail_alone(engine, peer, form):
    good = np.arange(4096 * 3, dtype=np.uint8)
    ro = np.zeros(4096, dtype=np.uint8)
    ro.flags.writeable = False
    engine.register(good), engine.register(ro)
    g = good.ctypes.data
    addrs = [g, 4096, g + 4096, g + 8192]
    roffs = [BASE, BASE, peer.size - 10, BASE + 4096]
    lens = [4096, 16, 4096, 4096]
    if form == "numpy":
        addrs, roffs, lens = np.array(addrs), np.array(roffs), np.array(lens)
    st = engine.write_spans(peer.descriptor, peer.region_id, addrs, roffs, lens)
    assert st[0] is None and st[3] is None
    assert isinstance(st[1], OutOfRange) and "no registered region" in str(st[1])
    assert isinstance(st[2], OutOfRange) and "outside" in str(st[2])
    assert peer.digest(BASE, 4096) == digest(good[:4096])
    assert peer.digest(BASE + 4096, 4096) == digest(good[8192:])
    st = engine.read_spans(peer.descriptor, peer.region_id, [ro.ctypes.data, g], [BASE, BASE], [4096, 4096])
    assert isinstance(st[0], OutOfRange) and "read-only" in str(st[0]) and st[1] is None
    assert not ro.any()


def test_bad_arguments_raise(engine, peer):
    buf = np.zeros(64, dtype=np.uint8)
    engine.register(buf)
    with pytest.raises(ValueError, match="differ in length"):
        engine.write_spans(
            peer.descriptor, peer.region_id, np.array([buf.ctypes.data]), np.array([0, 1]), np.array([1])
        )
    with pytest.raises(OutOfRange, match="negative"):
        engine.write_spans(
            peer.descriptor, peer.region_id, np.array([buf.ctypes.data] * 9), np.full(9, -1), np.ones(9, dtype=np.int64)
        )
    with pytest.raises(OutOfRange, match=">= 0"):
        engine.write_spans(peer.descriptor, peer.region_id, [buf.ctypes.data], [-1], [1])
    assert engine.write_spans(peer.descriptor, peer.region_id, [], [], []) == []
    assert engine.spans_registered(np.array([buf.ctypes.data, 8]), np.array([64, 1])).tolist() == [True, False]


@pytest.mark.parametrize("count", [3, 40])
def test_spans_report_the_xxh3_of_every_span_moved(engine, peer, count):
    """digests=: each span's xxh3_64 (shm hashes in its copy pass, the others from local memory), spans that
    are contiguous on both sides still get one digest each, and a bad span's neighbours are still hashed."""
    rng = np.random.default_rng(count)
    lens = rng.integers(1, 200_000, size=count)
    src = np.frombuffer(rng.bytes(int(lens.sum())), dtype=np.uint8)
    dst = np.zeros_like(src)
    engine.register(src), engine.register(dst)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    roffs = BASE + starts  # contiguous on both sides
    want = [xxhash.xxh3_64_intdigest(src[s : s + n]) for s, n in zip(starts, lens)]
    got = np.zeros(count, dtype=np.uint64)
    assert (
        engine.write_spans(peer.descriptor, peer.region_id, src.ctypes.data + starts, roffs, lens, digests=got)
        == [None] * count
    )
    assert got.tolist() == want
    got[:] = 0
    bad_roffs = roffs.copy()
    bad_roffs[1] = peer.descriptor.region(peer.region_id).length  # outside the region
    status = engine.read_spans(peer.descriptor, peer.region_id, dst.ctypes.data + starts, bad_roffs, lens, digests=got)
    assert isinstance(status[1], OutOfRange) and status.count(None) == count - 1
    assert [g for j, g in enumerate(got.tolist()) if j != 1] == [w for j, w in enumerate(want) if j != 1]


def test_spans_refuse_a_digest_array_of_the_wrong_shape(engine, peer):
    src = np.zeros(64, dtype=np.uint8)
    engine.register(src)
    with pytest.raises(ValueError, match="digests must be a writable uint64 array of 2"):
        engine.write_spans(
            peer.descriptor,
            peer.region_id,
            [src.ctypes.data] * 2,
            [BASE, BASE + 8],
            [8, 8],
            digests=np.zeros(3, dtype=np.uint64),
        )
