"""Staged pages (layout/staged.py, transfer/staging.py) on the CPU, against a real store cluster on loopback:
the same gather/scatter code a CUDA KV cache takes (tests/gpu/ runs it with CUDA tensors where a GPU exists).
Staged and direct pages are byte-identical and interchangeable; batches larger than a slot move in chunks
through the bounded pool; a page that fails to load leaves its block untouched; a busy pool is a miss, not a
hang; devices that cannot be staged are refused clearly."""

from __future__ import annotations

import threading

import pytest
from helpers.cluster import store_cluster
from helpers.pages import block_hashes as hashes

from kvplugins.errors import ConfigError, TransferFailed
from kvplugins.layout import KeySpace, PageLayout, PageStore
from kvplugins.layout.staged import SLOTS, StagedPages
from kvplugins.transfer.staging import StagingPool

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(120)
BLOCKS = 12
PAGE = 2 * 2 * (2 * 16 * 16 * 2)  # 2 layers x K/V planes x [kv_heads=2, block=16, head=16] float16
KS = KeySpace(
    model="staged", kv_dtype="float16", block_size=16, layer_group="l0,l1", tp_rank=0, tp_size=1, page_bytes=PAGE
)


def kv(seed: int | None) -> list:
    """Two FlashAttention-style layers [2 (K/V), num_blocks, block=16, kv_heads=2, head=16] float16."""
    if seed is None:
        return [torch.zeros(2, BLOCKS, 16, 2, 16, dtype=torch.float16) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, BLOCKS, 16, 2, 16, generator=g).to(torch.float16) for _ in range(2)]


def layout(tensors) -> PageLayout:
    return PageLayout.from_tensors(tensors, block_dim=1)


def client_factory(master: str):
    from kvplugins.store import ClientConfig, StoreClient

    return lambda: StoreClient(ClientConfig(master=master, rpc_timeout_ms=1000))


def staged_store(master, tensors, pages_per_slot: int = 2) -> PageStore:
    lay = layout(tensors)
    return PageStore(
        client_factory(master), KS, lay, staged=StagedPages(lay, SLOTS * pages_per_slot * PAGE, slot_timeout_s=5)
    )


@pytest.fixture(scope="module")
def master():
    with store_cluster(nodes=1, segment_size="16MiB") as c:
        yield c.master


def test_staged_save_and_load_match_the_direct_path(master):
    """5 pages through slots of 2 (three chunks): staged saves load directly and vice versa, byte for byte."""
    src = kv(1)
    staged, direct = staged_store(master, src), PageStore(client_factory(master), KS, layout(src))
    assert staged.save([1, 3, 5, 7, 9], hashes(5, 1)) == 5
    assert direct.save([0, 2, 4, 6, 8], hashes(5, 2)) == 5
    into_direct, into_staged = kv(None), kv(None)
    d, s = PageStore(client_factory(master), KS, layout(into_direct)), staged_store(master, into_staged)
    assert d.load([0, 1, 2, 3, 4], hashes(5, 1)) == []  # saved staged, loaded straight into the blocks
    assert s.load([11, 10, 9, 8, 7], hashes(5, 2)) == []  # saved straight, loaded staged
    for a, b, c in zip(src, into_direct, into_staged):
        assert torch.equal(b[:, 0:5], a[:, [1, 3, 5, 7, 9]])
        assert torch.equal(c[:, [11, 10, 9, 8, 7]], a[:, [0, 2, 4, 6, 8]])
        assert not b[:, 5:].any() and not c[:, 0:7].any()
    for p in (staged, direct, d, s):
        p.close()


def test_a_page_that_fails_to_load_leaves_its_block_untouched(master):
    src, dst = kv(3), kv(None)
    a, b = staged_store(master, src), staged_store(master, dst)
    assert a.save([0, 1, 2], hashes(3, 3)) == 3
    wanted = hashes(3, 3)
    wanted[1] = b"missing page".ljust(32, b".")
    assert b.load([4, 5, 6], wanted) == [5]
    for x, y in zip(src, dst):
        assert torch.equal(y[:, 4], x[:, 0]) and torch.equal(y[:, 6], x[:, 2])
        assert not y[:, 5].any()
    a.close(), b.close()


def test_a_save_reads_the_blocks_as_they_were_when_it_ran(master):
    """The gather copies a block into the slot before the put: a block rewritten afterwards does not change what
    was stored (vLLM's fence waits for this save before the block is reused)."""
    src = kv(4)
    before = [t.clone() for t in src]
    a = staged_store(master, src)
    assert a.save([2], hashes(1, 4)) == 1
    for t in src:
        t.fill_(7)
    dst = kv(None)
    b = staged_store(master, dst)
    assert b.load([0], hashes(1, 4)) == []
    assert all(torch.equal(y[:, 0], x[:, 2]) for x, y in zip(before, dst))
    a.close(), b.close()


def test_busy_pool_is_a_miss_not_a_hang(master):
    dst = kv(None)
    lay = layout(dst)
    staged = StagedPages(lay, SLOTS * PAGE, slot_timeout_s=0.2)
    held = [staged.pool.slot(5) for _ in range(SLOTS)]
    for cm in held:
        cm.__enter__()
    p = PageStore(client_factory(master), KS, lay, staged=staged)
    assert p.save([0], hashes(1, 5)) == 0  # every slot in use: not saved, no hang, no raise
    assert p.stats["store_errors"] == 0  # and the store is not marked down for it
    for cm in held:
        cm.__exit__(None, None, None)
    assert p.save([0], hashes(1, 5)) == 1
    p.close()


def test_pool_bounds_and_errors_name_the_fix():
    with pytest.raises(ConfigError, match="raise bounce_bytes to at least"):
        StagedPages(layout(kv(None)), PAGE, slot_timeout_s=1)
    with pytest.raises(ConfigError, match="holds no slot"):
        StagingPool(bytearray(10), 10, 64)
    pool = StagingPool(torch.empty(3 * 64, dtype=torch.uint8), 3 * 64, 64)
    got, done = [], threading.Event()
    with pool.slot(1) as a, pool.slot(1) as b, pool.slot(1) as c:
        assert len({a.addr, b.addr, c.addr}) == 3
        with pytest.raises(TransferFailed, match="no staging slot free"):
            with pool.slot(0.05):
                pass
        threading.Thread(target=lambda: (got.append(pool.slot(5).__enter__()), done.set())).start()
    assert done.wait(5) and got[0].addr in {a.addr, b.addr, c.addr}  # a waiter gets the slot freed


def test_devices_that_cannot_be_staged_are_refused_by_name():
    meta = [torch.empty(2, BLOCKS, 16, 2, 16, dtype=torch.float16, device="meta")]
    with pytest.raises(ConfigError, match="KV tensors on meta: pages are staged from CUDA or CPU memory only"):
        StagedPages(layout(meta), 64 * PAGE, slot_timeout_s=1)
    with pytest.raises(ConfigError, match="cannot be registered with the transfer core"):
        layout(meta).regions()
    if not torch.cuda.is_available():
        lay = layout(kv(None))
        lay.device = "cuda:0"  # the layout of a CUDA KV cache, as a CPU-only torch would be asked to stage it
        with pytest.raises(ConfigError, match="has no CUDA device; install the CUDA build of torch"):
            StagedPages(lay, 64 * PAGE, slot_timeout_s=1)
