"""Pages stored per KV head (layout/shards.py) against a real store on loopback: which heads a TP rank holds,
a head's planes in vLLM CPU's head-major layout, and pages written by two "TP 2" ranks read back whole by one
"TP 1" rank (and the reverse), byte for byte; a replica rank saves nothing."""

from __future__ import annotations

import pytest
import torch
from helpers.cluster import store_cluster

from kvplugins.errors import ConfigError
from kvplugins.layout import KeySpace, PageLayout, PageStore
from kvplugins.layout.shards import HeadShards, RankHeads, rank_heads
from kvplugins.layout.spans import head_planes

pytestmark = pytest.mark.timeout(120)
HEADS, BLOCKS, L, D = 4, 6, 16, 8


def test_rank_heads_split_and_replicate_as_vllm_does():
    assert [rank_heads(r, 2, 4) for r in range(2)] == [RankHeads(0, 2, 4), RankHeads(2, 2, 4)]
    assert rank_heads(0, 1, 4) == RankHeads(0, 4, 4)
    assert [rank_heads(r, 8, 4) for r in (0, 1, 6, 7)] == [
        RankHeads(0, 1, 4),
        RankHeads(0, 1, 4, writes=False),
        RankHeads(3, 1, 4),
        RankHeads(3, 1, 4, writes=False),
    ]
    with pytest.raises(ConfigError, match="6 KV heads over TP size 4"):
        rank_heads(0, 4, 6)


def test_head_planes_hold_exactly_that_heads_bytes():
    t = torch.arange(2 * BLOCKS * HEADS * L * D, dtype=torch.float32).reshape(2, BLOCKS, HEADS, L, D)  # K/V, HND
    planes = head_planes(t, 1, HEADS, 2)
    assert len(planes) == 2 and all(p.block_bytes == L * D * 4 for p in planes)
    got = [
        torch.frombuffer(bytearray((ctypes_bytes(p.base + 3 * p.block_stride, p.block_bytes))), dtype=torch.float32)
        for p in planes
    ]
    assert torch.equal(got[0], t[0, 3, 2].flatten()) and torch.equal(got[1], t[1, 3, 2].flatten())
    assert head_planes(torch.zeros(2, BLOCKS, L, HEADS, D), 1, HEADS, 0) is None  # NHD: a run per token


def ctypes_bytes(addr: int, n: int) -> bytes:
    import ctypes

    return ctypes.string_at(addr, n)


@pytest.fixture(scope="module")
def master():
    with store_cluster(nodes=1, segment_size="32MiB") as c:
        yield c.master


OPEN: list[HeadShards] = []


@pytest.fixture(autouse=True)
def closed():
    """Every HeadShards a test made is closed after it (their clients' transfer engines stop)."""
    yield
    while OPEN:
        OPEN.pop().close()


def _factory(master):
    from kvplugins.store import ClientConfig, StoreClient

    return lambda: StoreClient(ClientConfig(master=master, rpc_timeout_ms=2000))


def _rank(master, tp_rank: int, tp: int, layers: list[torch.Tensor]) -> HeadShards:
    """The HeadShards a worker at TP ``tp`` builds over its KV tensors (2 layers of [2, blocks, heads/tp, L, D])."""
    h = rank_heads(tp_rank, tp, HEADS)
    base = KeySpace(
        model="m",
        kv_dtype="float32",
        block_size=L,
        layer_group="l0,l1",
        tp_rank=0,
        tp_size=HEADS,
        page_bytes=2 * 2 * L * D * 4,
    )
    parts, first = [], None
    for j in range(h.count):
        layout = PageLayout([p for t in layers for p in head_planes(t, 1, h.count, j)])
        ks = KeySpace(**{**base.__dict__, "tp_rank": h.first + j})
        parts.append(PageStore(_factory(master), ks, layout, share=first))
        first = first or parts[0]
    OPEN.append(HeadShards(parts, PageLayout.from_tensors(layers, 1), h.writes))
    return OPEN[-1]


def _kv(heads: int, seed: int | None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(2, BLOCKS, heads, L, D) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, BLOCKS, heads, L, D, generator=g) for _ in range(2)]


def test_tp2_ranks_write_heads_a_tp1_rank_reads_whole_pages_and_back(master):
    full = _kv(HEADS, 1)  # what a TP 1 engine would hold
    halves = [[t[:, :, r * 2 : (r + 1) * 2].contiguous() for t in full] for r in range(2)]
    hashes = [bytes([7, i]) * 16 for i in range(3)]
    for r in range(2):  # "TP 2": blocks 1..3 of each rank
        assert _rank(master, r, 2, halves[r]).save_held([1, 2, 3], hashes) == (3, [True] * 3)
    into = _kv(HEADS, None)
    assert _rank(master, 0, 1, into).load([0, 4, 5], hashes) == []  # "TP 1" reads all four heads
    for src, dst in zip(full, into):
        assert torch.equal(dst[:, [0, 4, 5]], src[:, [1, 2, 3]])
    back = [_kv(2, None) for _ in range(2)]  # and "TP 2" reads what "TP 1" wrote
    more = [bytes([8, i]) * 16 for i in range(2)]
    assert _rank(master, 0, 1, full).save_held([0, 5], more)[0] == 2
    for r in range(2):
        assert _rank(master, r, 2, back[r]).load([2, 3], more) == []
        for src, dst in zip(full, back[r]):
            assert torch.equal(dst[:, [2, 3]], src[:, [0, 5], r * 2 : (r + 1) * 2])


def test_a_missing_head_fails_the_page_and_a_replica_writes_nothing(master):
    hashes = [bytes([9, i]) * 16 for i in range(2)]
    full = _kv(HEADS, 2)
    quarters = [[t[:, :, r : r + 1].contiguous() for t in full] for r in range(8)]
    replica = _rank(master, 1, 8, quarters[0])  # TP 8: rank 1 holds head 0 again
    assert replica.save_held([0, 1], hashes) == (0, [True, True])
    only_head0 = _rank(master, 0, 8, quarters[0])
    assert only_head0.save_held([0, 1], hashes)[0] == 2
    into = _kv(HEADS, None)
    assert _rank(master, 0, 1, into).load([2, 3], hashes) == [2, 3]  # heads 1-3 never stored: both pages fail
