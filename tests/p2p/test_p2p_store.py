"""kvplugins.p2p against a real etcd, peers as real TransferEngines over TCP (several in this process; the
dying-peer test uses real processes): objects pulled whole and verified, served on by every puller, peers
routed around when they fail or lie, peers never able to write a holder's memory. Over RDMA in the soft-RoCE
guest with KVPLUGINS_TEST_P2P_TRANSPORTS=rdma,tcp (tests/rdma/test_guest.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvplugins.errors import ChecksumMismatch, ConfigError, KeyNotFound, SizeMismatch, StoreError, TransferError
from kvplugins.p2p import P2PConfig, P2PStore
from kvplugins.transfer import TransferEngine, TransferRequest
from kvplugins.transfer.config import TransferConfig
from tests.helpers.etcd import etcd_server

CHUNK = 256 << 10
TRANSPORTS = os.environ.get("KVPLUGINS_TEST_P2P_TRANSPORTS", "tcp")  # the soft-RoCE guest: "rdma,tcp"


@pytest.fixture(scope="module")
def etcd():
    with etcd_server() as e:
        yield e


@pytest.fixture
def peers(etcd, request):
    """A factory of P2PStores on one catalog prefix of this test, closed at its end."""
    made = []
    prefix = "/t/" + request.node.name.replace("[", "_").replace("]", "_")

    def make(**kw) -> P2PStore:
        cfg = P2PConfig(etcd=etcd.endpoint + prefix, chunk_bytes=CHUNK, transports=TRANSPORTS, **kw)
        made.append(P2PStore(cfg))
        return made[-1]

    yield make
    for s in made:
        s.close()


def blobs(seed: int, *sizes: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def test_a_pulled_object_is_whole_and_every_puller_serves_it_on(peers):
    gold, first, second = peers(), peers(), peers()
    src = blobs(1, 5 * CHUNK + 123, 1000)
    p = gold.register("ckpt/step1", src)
    assert [(c.buffer, c.length) for c in p.chunks] == [(0, CHUNK)] * 5 + [(0, 123), (1, 1000)]

    got = [np.zeros_like(b) for b in src]
    st = first.get_replica("ckpt/step1", got)
    assert all((a == b).all() for a, b in zip(src, got))
    assert st.bytes == sum(b.nbytes for b in src) and st.from_peers == {gold.me: st.bytes}

    again = [np.zeros_like(b) for b in src]
    st2 = second.get_replica("ckpt/step1", again)
    assert all((a == b).all() for a, b in zip(src, again))
    assert st2.from_peers.get(first.me, 0) > 0  # the replica served too (read before the publisher)
    [info] = second.list("ckpt/")
    assert (info.holders, info.complete, info.chunks, info.sizes) == (3, 3, 7, (5 * CHUNK + 123, 1000))
    if "rdma" in TRANSPORTS:  # the guest: RDMA carried every chunk
        stats = second.engine.stats()
        assert "rdma" in stats and not stats["fallbacks"], stats


def test_a_replica_that_serves_wrong_bytes_is_read_around_and_never_kept(peers):
    gold, liar, puller = peers(), peers(), peers(parallel=1)
    src = blobs(2, 4 * CHUNK)
    gold.register("w", src)
    held = [np.zeros_like(src[0])]
    liar.get_replica("w", held)
    held[0][CHUNK + 7] ^= 0xFF  # the replica's chunk 1 rots after it was verified

    got = [np.zeros_like(src[0])]
    st = puller.get_replica("w", got)
    assert (got[0] == src[0]).all()
    assert st.mismatched == 1 and st.from_peers[gold.me] >= CHUNK  # chunk 1 read again from the gold


def test_a_chunk_no_holder_serves_right_fails_the_pull_and_nothing_is_served(peers):
    gold, puller = peers(), peers(stall_timeout_ms=500)
    src = blobs(3, 2 * CHUNK)
    gold.register("rot", src)
    src[0][5] ^= 1  # the only copy changed after registering
    with pytest.raises(ChecksumMismatch, match="chunk 0"):
        puller.get_replica("rot", [np.zeros_like(src[0])])
    assert puller.holding() == []
    [info] = gold.list("rot")
    assert info.holders == 1  # the failed puller listed nothing


def test_peers_may_read_a_holders_memory_but_never_write_it(peers):
    gold = peers()
    src = blobs(4, CHUNK)
    gold.register("ro", src)
    [(h, desc)] = gold.catalog.holders(gold.catalog.get("ro"))
    other = TransferEngine(TransferConfig(transports=TRANSPORTS))
    try:
        mine = other.register(np.full(64, 7, dtype=np.uint8))
        dst = other.register(np.zeros(64, dtype=np.uint8))
        [read] = other.batch_read([TransferRequest(dst, 0, desc, h.regions[0], 0, 64)])
        assert read is None and (other.memoryview(dst).tobytes() == src[0][:64].tobytes())
        [write] = other.batch_write([TransferRequest(mine, 0, desc, h.regions[0], 0, 64)])
        assert isinstance(write, TransferError) and "read-only" in str(write)
        assert (src[0][:64] != 7).any()
    finally:
        other.close()


def test_bad_calls_name_the_value_and_the_fix(peers):
    gold, puller = peers(), peers()
    src = blobs(5, CHUNK + 1, 10)
    gold.register("x", src)
    with pytest.raises(StoreError, match="exists"):
        peers().register("x", src)
    with pytest.raises(ConfigError, match="held by this peer already"):
        gold.register("x", src)
    with pytest.raises(KeyNotFound, match="not in the catalog"):
        puller.get_replica("nope", [np.zeros(4, dtype=np.uint8)])
    with pytest.raises(SizeMismatch, match=r"buffer 1"):
        puller.get_replica("x", [np.zeros(CHUNK + 1, dtype=np.uint8), np.zeros(11, dtype=np.uint8)])
    with pytest.raises(KeyNotFound, match="use unregister"):
        gold.delete_replica("x")
    assert puller.holding() == []


def test_a_forced_registration_starts_a_new_generation(peers):
    old, new, puller = peers(), peers(), peers()
    old.register("g", blobs(6, CHUNK))
    src = blobs(7, CHUNK)
    new.register("g", src, force=True)
    got = [np.zeros(CHUNK, dtype=np.uint8)]
    st = puller.get_replica("g", got)
    assert (got[0] == src[0]).all() and set(st.from_peers) == {new.me}  # the old holder no longer counts


def test_the_last_holder_to_leave_removes_the_object(peers):
    gold, rep = peers(), peers()
    src = blobs(8, CHUNK)
    gold.register("bye", src)
    rep.get_replica("bye", [np.zeros(CHUNK, dtype=np.uint8)])
    gold.unregister("bye")
    [info] = rep.list("bye")
    assert (info.holders, info.complete) == (1, 1)  # the replica still serves it
    got = [np.zeros(CHUNK, dtype=np.uint8)]
    peers().get_replica("bye", got)
    assert (got[0] == src[0]).all()
    rep.unregister("bye")
    assert [i.name for i in rep.list("bye")] == ["bye"]  # the last puller still holds it
