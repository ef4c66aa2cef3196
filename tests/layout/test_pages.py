"""PageStore against a real store cluster on loopback: zero-copy page save/load between two processes'
worth of "KV memory" (numpy arrays), prefix lookups across TP ranks, and serving through a store outage."""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest
from helpers.cluster import store_cluster

from kvplugins.layout import KeySpace, PageLayout, PageStore

pytestmark = pytest.mark.timeout(120)
KS = KeySpace(
    model="test",
    kv_dtype="float16",
    block_size=16,
    layer_group="l0,l1",
    tp_rank=0,
    tp_size=1,
    page_bytes=2 * 2 * 16 * 16 * 2,
)


def kv(seed: int | None = None) -> list[np.ndarray]:
    """Two layers of [num_blocks=8, kv_heads=2, block=16, head*2=16] float16, random or zero."""
    if seed is None:
        return [np.zeros((8, 2, 16, 16), np.float16) for _ in range(2)]
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((8, 2, 16, 16)).astype(np.float16) for _ in range(2)]


def hashes(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 16 for i in range(n)]


def client_factory(master: str, **kw):
    from kvplugins.store import ClientConfig, StoreClient

    return lambda: StoreClient(ClientConfig(master=master, rpc_timeout_ms=500, **kw))


@pytest.fixture(scope="module")
def master():
    with store_cluster(nodes=1, segment_size="16MiB") as c:
        yield c.master


def test_save_then_load_into_other_blocks(master):
    src, dst = kv(1), kv()
    a = PageStore(client_factory(master), KS, PageLayout.from_tensors(src))
    b = PageStore(client_factory(master), KS, PageLayout.from_tensors(dst))
    h = hashes(3)
    assert a.save([5, 6, 7], h) == 3
    assert a.save([5, 6, 7], h) == 0  # already stored: skipped after one exists RPC
    assert a.stats["skipped_pages"] == 3
    assert b.stored_prefix(h + hashes(2, salt=9)) == 3
    assert b.load([0, 1, 2], h) == []
    for layer_src, layer_dst in zip(src, dst):
        assert np.array_equal(layer_dst[0:3], layer_src[5:8])
        assert not layer_dst[3:].any()
    a.close(), b.close()


def test_missing_page_reports_its_block(master):
    dst = kv()
    p = PageStore(client_factory(master), KS, PageLayout.from_tensors(dst))
    assert p.load([4], hashes(1, salt=61)) == [4]
    assert p.stats["failed_pages"] == 1
    p.close()


def test_page_failing_its_checksum_leaves_its_block_zeroed(master):
    """Bytes read into a block that fail the object's checksum never stay there: an engine may reuse the freed
    block partly filled, and masked garbage (inf) turns attention into NaN. The good page beside it loads."""
    from helpers.corrupt import flip_stored_byte

    src = kv(2)
    src[0][1, 0, 0, 0] = np.inf  # bytes that would poison a reused block
    dst = [np.full_like(layer, 7) for layer in kv()]
    a = PageStore(client_factory(master), KS, PageLayout.from_tensors(src))
    b = PageStore(client_factory(master), KS, PageLayout.from_tensors(dst))
    h = hashes(2, salt=4)
    assert a.save([0, 1], h) == 2
    flip_stored_byte(a._connected(), KS.keys(h[1:])[0], at=KS.page_bytes - 1)
    assert b.load([3, 4], h) == [4]
    for layer_src, layer_dst in zip(src, dst):
        assert np.array_equal(layer_dst[3], layer_src[0])  # the good page
        assert not layer_dst[4].any()  # the failed one: zeros, not the bytes read
        assert (layer_dst[5:] == 7).all() and (layer_dst[:3] == 7).all()  # no other block touched
    a.close(), b.close()


def test_prefix_needs_every_tp_rank(master):
    ks2 = KeySpace(**{**KS.__dict__, "tp_size": 2, "model": "tp"})
    r0, r1 = kv(2), kv(3)
    w0 = PageStore(client_factory(master), ks2, PageLayout.from_tensors(r0))
    w1 = PageStore(client_factory(master), ks2.for_rank(1), PageLayout.from_tensors(r1))
    h = hashes(4, salt=3)
    w0.save([0, 1, 2, 3], h)
    w1.save([0, 1], h[:2])
    sched = PageStore(client_factory(master), ks2, required=[ks2, ks2.for_rank(1)])
    assert sched.stored_prefix(h) == 2
    for p in (w0, w1, sched):
        p.close()


def test_store_down_is_a_miss_logged_once(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    dst = kv()
    p = PageStore(client_factory(dead), KS, PageLayout.from_tensors(dst), retry_ms=60000)
    with caplog.at_level(logging.WARNING, logger="kvplugins.layout.pages"):
        assert not p.connect()
        assert p.stored_prefix(hashes(2)) == 0
        assert p.load([1, 2], hashes(2)) == [1, 2]
        assert p.save([1], hashes(1)) == 0
    assert sum("store unavailable" in r.message for r in caplog.records) == 1
    assert p.stats["store_errors"] == 1  # later calls did not retry inside the back-off window


def test_load_while_the_store_is_down_zeroes_the_blocks_it_was_to_fill():
    """A block vLLM handed over for a load holds whatever an earlier request left (or never-written memory,
    possibly inf/NaN); when the store is down the load fails and the block must read as zeros, as for every
    other failure, not keep those bytes. Blocks not in the load are untouched."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    dst = kv(seed=3)
    for layer in dst:
        layer[1:3] = np.inf
    before = [layer.copy() for layer in dst]
    p = PageStore(client_factory(dead), KS, PageLayout.from_tensors(dst), retry_ms=60000)
    assert not p.connect()  # down, and inside the back-off: load_pages gets no client
    assert p.load([1, 2], hashes(2)) == [1, 2]
    for layer, old in zip(dst, before):
        assert not layer[1:3].any()
        np.testing.assert_array_equal(layer[[0, 3, 4, 5, 6, 7]], old[[0, 3, 4, 5, 6, 7]])
    assert p.stats["failed_pages"] == 2


def test_a_load_found_after_the_failure_reconnects_inside_the_back_off(master):
    """Inside the back-off a load reconnects at once when the store failed before the lookup that found its
    pages (found_at), and does not when it failed since (the store is still failing: not waited for again)."""
    import time

    calls = []
    real = client_factory(master)

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            from kvplugins.errors import MasterUnreachable

            raise MasterUnreachable(master, 1, "injected first failure")
        return real()

    src = kv(5)
    writer = PageStore(real, KS, PageLayout.from_tensors(src))
    writer.save([0], hashes(1, salt=5))
    writer.close()
    dst = kv()
    p = PageStore(flaky, KS, PageLayout.from_tensors(dst), retry_ms=60000)
    before = time.monotonic()
    assert not p.connect()
    assert p.stored_prefix(hashes(1, salt=5)) == 0  # lookups respect the back-off
    assert p.load([3], hashes(1, salt=5), found_at=before) == [3]  # found before the failure: not retried
    assert len(calls) == 1 and not dst[0][3].any()
    assert p.load([3], hashes(1, salt=5), found_at=time.monotonic()) == []  # found since: retried at once
    assert np.array_equal(dst[0][3], src[0][0]) and len(calls) == 2
    p.close()


def test_a_node_that_stops_answering_costs_one_transfer_timeout_not_one_per_call():
    """A store node frozen (SIGSTOP, real processes): the first load from it waits its transfer timeout and
    fails; the PageStore then backs off, so the save and the load after it answer at once ("not saved" /
    failed) instead of each waiting for the node again. Once it answers (SIGCONT) and the back-off has passed,
    a load found after that lands the right bytes."""
    import signal
    import time

    with store_cluster(nodes=1, segment_size="16MiB", node_flags={"transports": "tcp"}) as c:  # as across hosts
        src = kv(11)
        writer = PageStore(client_factory(c.master), KS, PageLayout.from_tensors(src))
        h = hashes(2, salt=11)
        assert writer.save([0, 1], h) == 2
        writer.close()
        dst = kv()
        slow = client_factory(c.master, transfer_timeout_ms=1500, transports="tcp")
        p = PageStore(slow, KS, PageLayout.from_tensors(dst), retry_ms=3000)
        assert p.connect() and p.stored_prefix(h) == 2
        c.nodes[0].popen.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert p.load([4, 5], h, found_at=t0) == [4, 5]
            first = time.monotonic() - t0
            t1 = time.monotonic()
            assert p.save([6], hashes(1, salt=12)) == 0
            assert p.load([4, 5], h, found_at=t0) == [4, 5]
            after = time.monotonic() - t1
        finally:
            c.nodes[0].popen.send_signal(signal.SIGCONT)
        assert first >= 1.4 and after < 0.5, (first, after)
        assert p.stats["store_errors"] == 1 and not dst[0][4:6].any()
        time.sleep(3.1)  # the back-off
        assert p.load([4, 5], h, found_at=time.monotonic()) == []
        assert np.array_equal(dst[0][4:6], src[0][0:2]) and np.array_equal(dst[1][4:6], src[1][0:2])
        p.close()


def test_lookup_only_store_refuses_load_clearly(master):
    from kvplugins.errors import KVPluginsError

    p = PageStore(client_factory(master), KS)
    with pytest.raises(KVPluginsError, match="no KV memory layout"):
        p.load([0], hashes(1))
    p.close()


def test_groups_share_one_client_and_its_outage(master):
    """A hybrid model's groups: two PageStores (own key spaces and KV memory) on one client: one connection,
    both memories registered, pages of one group never found in the other, one outage is both groups'."""
    from dataclasses import replace

    made = []

    def factory():
        made.append(client_factory(master)())
        return made[-1]

    full_kv, window_kv, dst_full, dst_window = kv(2), kv(3), kv(), kv()
    full = PageStore(factory, KS, PageLayout.from_tensors(full_kv))
    window = PageStore(factory, replace(KS, layer_group="l2,l3"), PageLayout.from_tensors(window_kv), share=full)
    h = hashes(2, salt=7)
    assert full.save([1, 2], h) == 2 and window.save([3, 4], h) == 2
    assert len(made) == 1
    reader = PageStore(factory, KS, PageLayout.from_tensors(dst_full))
    reader_w = PageStore(factory, replace(KS, layer_group="l2,l3"), PageLayout.from_tensors(dst_window), share=reader)
    assert reader_w.load([0, 1], h) == [] and reader.load([0, 1], h) == []
    assert len(made) == 2
    for got, want in zip(dst_full, full_kv):
        assert np.array_equal(got[0:2], want[1:3])
    for got, want in zip(dst_window, window_kv):
        assert np.array_equal(got[0:2], want[3:5])
    assert window.stored_mask(h + hashes(1, salt=8)) == [True, True, False]
    assert window.save([5], hashes(1, salt=9)) == 1 and full.stored_mask(hashes(1, salt=9)) == [False]
    window._failed(RuntimeError("test: the store went away"))  # one group's failure
    assert full._connected() is None and window._connected() is None  # both serve without the store now
    assert made[0]._closed  # the failure closed the one client
    full.close(), window.close(), reader_w.close(), reader.close()
