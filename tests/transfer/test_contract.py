"""The transfer contract against a real peer process, for every transport: exact bytes for 1 B..64 MiB,
misaligned offsets, batches, both directions, blocking and future forms, per-entry OutOfRange."""

from dataclasses import replace

import numpy as np
import pytest

from helpers.peer import GUARDED_SIZE, digest, seeded
from kvplugins.errors import OutOfRange, TransferError
from kvplugins.transfer import TransferConfig, TransferEngine, TransferRequest

SIZES = [1, 7, 4099, (1 << 20) + 3, 64 << 20]


def run(engine, op, reqs, form):
    if form == "future":
        fut = (engine.submit_write if op == "write" else engine.submit_read)(reqs)
        return fut.result(timeout=30)
    return (engine.batch_write if op == "write" else engine.batch_read)(reqs)


@pytest.mark.parametrize("form", ["blocking", "future"])
@pytest.mark.parametrize("size", SIZES)
def test_write_then_read_exact_bytes(engine, peer, size, form):
    rng = np.random.default_rng(size)
    src = np.frombuffer(rng.bytes(size + 5), dtype=np.uint8)
    local = engine.register(src)
    remote_off = 13 if size < (64 << 20) else 3  # misaligned on both sides
    w = TransferRequest(local, 5, peer.descriptor, peer.region_id, remote_off, size)
    assert run(engine, "write", [w], form) == [None]
    assert peer.digest(remote_off, size) == digest(src[5 : 5 + size])
    dst = np.zeros(size + 9, dtype=np.uint8)
    back = engine.register(dst)
    r = TransferRequest(back, 9, peer.descriptor, peer.region_id, remote_off, size)
    assert run(engine, "read", [r], form) == [None]
    assert np.array_equal(dst[9:], src[5 : 5 + size])
    assert not dst[:9].any()  # bytes outside the entry untouched


def test_read_initial_peer_bytes(engine, peer):
    off = 72 << 20  # no other test writes there
    expected = seeded(peer.size, peer.seed)[off : off + 70001]
    dst = engine.register(bytearray(70001))
    req = TransferRequest(dst, 0, peer.descriptor, peer.region_id, off, 70001)
    assert engine.batch_read([req]) == [None]
    assert bytes(engine.memoryview(dst)) == expected.tobytes()


@pytest.mark.parametrize("form", ["blocking", "future"])
def test_batch_of_many_entries(engine, peer, form):
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 40000, size=300)
    total = int(lengths.sum())
    src = np.frombuffer(rng.bytes(total), dtype=np.uint8)
    local = engine.register(src)
    base = 40 << 20
    offs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
    order = rng.permutation(len(lengths))  # remote placement shuffled: scatter/gather both ways
    remote_offs = {}
    pos = base
    for i in order:
        remote_offs[i] = pos
        pos += int(lengths[i]) + 1
    writes = [
        TransferRequest(local, int(offs[i]), peer.descriptor, peer.region_id, remote_offs[i], int(lengths[i]))
        for i in range(len(lengths))
    ]
    assert run(engine, "write", writes, form) == [None] * len(writes)
    i = int(order[7])
    assert peer.digest(remote_offs[i], int(lengths[i])) == digest(src[offs[i] : offs[i] + lengths[i]])
    dst = np.zeros(total, dtype=np.uint8)
    back = engine.register(dst)
    reads = [
        TransferRequest(back, r.local_offset, r.remote, r.remote_region, r.remote_offset, r.length) for r in writes
    ]
    assert run(engine, "read", reads, form) == [None] * len(reads)
    assert np.array_equal(dst, src)


def test_a_region_read_only_to_peers_is_read_never_written(engine, peer, transport):
    if transport in ("shm", "cma"):
        pytest.skip(
            "shm serves only alloc_shared memory; a cma peer of the same user may write any of the owner's memory "
            "(the kernel's rule, not ours): peer_readonly is enforced where a server moves the bytes (tcp, rdma)"
        )
    n = GUARDED_SIZE
    dst = engine.register(np.zeros(n, dtype=np.uint8))
    assert engine.batch_read([TransferRequest(dst, 0, peer.descriptor, peer.guarded_id, 0, n)]) == [None]
    assert bytes(engine.memoryview(dst)) == seeded(n, peer.seed + 1).tobytes()
    src = engine.register(np.full(n, 0xAB, dtype=np.uint8))
    [err] = engine.batch_write([TransferRequest(src, 0, peer.descriptor, peer.guarded_id, 0, n)])
    assert isinstance(err, OutOfRange) and "read-only to peers" in str(err)  # refused before any transport
    # A writer that ignores the mark: the peer's server (tcp) or memory registration (rdma) refuses the bytes.
    # Its own engine: an RDMA remote access error sends the entry on to tcp, which the fixture's check forbids.
    hostile = TransferEngine(TransferConfig(transports=engine.config.transports, timeout_ms=30000))
    try:
        lied = replace(peer.descriptor, regions=tuple(replace(r, readonly=False) for r in peer.descriptor.regions))
        mine = hostile.register(np.full(n, 0xAB, dtype=np.uint8))
        [err] = hostile.batch_write([TransferRequest(mine, 0, lied, peer.guarded_id, 0, n)])
        assert isinstance(err, TransferError), err
    finally:
        hostile.close()
    assert peer.digest(0, n, peer.guarded_id) == digest(seeded(n, peer.seed + 1))


def test_out_of_range_entry_fails_alone(engine, peer):
    src = np.frombuffer(np.random.default_rng(1).bytes(8192), dtype=np.uint8)
    local = engine.register(src)
    d, rid = peer.descriptor, peer.region_id
    reqs = [
        TransferRequest(local, 0, d, rid, 100, 4096),
        TransferRequest(local, 0, d, rid, peer.size - 10, 4096),  # runs past the remote end
        TransferRequest(local, 0, d, 999_999, 0, 16),  # unknown region
        TransferRequest(local, 8000, d, rid, 0, 4096),  # runs past the local end
        TransferRequest(local, 4096, d, rid, 9000, 4096),
    ]
    st = engine.batch_write(reqs)
    assert st[0] is None and st[4] is None
    assert all(isinstance(e, OutOfRange) for e in st[1:4])
    assert peer.digest(100, 4096) == digest(src[:4096])
    assert peer.digest(9000, 4096) == digest(src[4096:])


def test_zero_length_entry_is_a_no_op(engine, peer):
    local = engine.register(bytearray(16))
    assert engine.batch_read([TransferRequest(local, 16, peer.descriptor, peer.region_id, 0, 0)]) == [None]


def test_frames_fit_a_peer_with_a_smaller_max_frame():
    from helpers.peer import Peer
    from kvplugins.transfer import TransferConfig, TransferEngine

    size = 4 << 20
    with (
        Peer(transports="tcp", size=size, max_frame=1 << 20) as peer,
        TransferEngine(TransferConfig(transports="tcp", max_frame=64 << 20)) as eng,
    ):
        assert peer.descriptor.transports["tcp"]["max_frame"] == 1 << 20
        src = np.frombuffer(np.random.default_rng(2).bytes(size), dtype=np.uint8)
        local = eng.register(src)
        req = TransferRequest(local, 0, peer.descriptor, peer.region_id, 0, size)
        assert eng.batch_write([req]) == [None]
        assert peer.digest(0, size) == digest(src)
        dst = np.zeros(size, dtype=np.uint8)
        assert eng.batch_read([TransferRequest(eng.register(dst), 0, peer.descriptor, peer.region_id, 0, size)]) == [
            None
        ]
        assert np.array_equal(dst, src)
