"""Staged pages with a CUDA KV cache (layout/staged.py) against a real store on loopback: the path a GPU vLLM
worker takes. Skipped without a GPU (conftest.py); CI runs the same code on CPU (tests/layout/test_staged.py)."""

from __future__ import annotations

import pytest
import torch
from helpers.pages import block_hashes as hashes

from kvplugins.layout import KeySpace, PageLayout, PageStore
from kvplugins.layout.staged import SLOTS, StagedPages

pytestmark = pytest.mark.timeout(300)
BLOCKS = 64
PAGE = 2 * 2 * (16 * 8 * 128 * 2)  # 2 layers x K/V x [block=16, kv_heads=8, head=128] bfloat16
KS = KeySpace(
    model="gpu", kv_dtype="bfloat16", block_size=16, layer_group="l0,l1", tp_rank=0, tp_size=1, page_bytes=PAGE
)


def kv(seed: int | None, device: str = "cuda") -> list:
    """Two FlashAttention layers [2 (K/V), num_blocks, block=16, kv_heads=8, head=128] bfloat16 on ``device``."""
    if seed is None:
        return [torch.zeros(2, BLOCKS, 16, 8, 128, dtype=torch.bfloat16, device=device) for _ in range(2)]
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(2, BLOCKS, 16, 8, 128, generator=g).to(torch.bfloat16).to(device) for _ in range(2)]


def store(master, tensors) -> PageStore:
    from kvplugins.store import ClientConfig, StoreClient

    lay = PageLayout.from_tensors(tensors, block_dim=1)
    return PageStore(
        lambda: StoreClient(ClientConfig(master=master)),
        KS,
        lay,
        staged=StagedPages(lay, SLOTS * 8 * PAGE, slot_timeout_s=10) if lay.device != "cpu" else None,
    )


def test_cuda_pages_round_trip_and_match_cpu_pages(master):
    src = kv(1)
    gpu = store(master, src)
    assert gpu.staged is not None and gpu.staged.copier.host_buffer(64).is_pinned() is True
    assert gpu.save(list(range(20)), hashes(20, 1)) == 20  # 3 chunks of 8 pages
    on_cpu = kv(None, "cpu")
    cpu = store(master, on_cpu)
    assert cpu.load(list(range(20, 40)), hashes(20, 1)) == []  # the same bytes, read straight into CPU KV
    dst = kv(None)
    back = store(master, dst)
    assert back.load(list(range(40, 60)), hashes(20, 1)) == []
    torch.cuda.synchronize()
    for a, c, d in zip(src, on_cpu, dst):
        assert torch.equal(c[:, 20:40], a[:, 0:20].cpu()) and torch.equal(d[:, 40:60], a[:, 0:20])
    for p in (gpu, cpu, back):
        p.close()


def test_a_save_waits_for_the_forward_that_wrote_the_blocks(master):
    """The engine enqueues a long kernel and then writes block 3 on its stream; the save, marked after that
    write, must store the written bytes even though the host thread never synchronized."""
    src = kv(2)
    p = store(master, src)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big / 64  # keeps the compute stream busy for a while
    for t in src:
        t[:, 3].fill_(1.5)
    assert p.save([3], hashes(1, 2), after=p.staged.mark()) == 1
    dst = kv(None, "cpu")
    q = store(master, dst)
    assert q.load([0], hashes(1, 2)) == []
    assert all(bool((t[:, 0] == 1.5).all()) for t in dst)
    p.close(), q.close()
