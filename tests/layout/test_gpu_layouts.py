"""The KV layouts GPU attention backends declare, built on CPU with torch tensors in those physical layouts
(no GPU here; vLLM 0.32 names them in vllm/v1/kv_cache_layout.py): NHD (FlashAttention ``[2, B, N, H, C]``),
HND (a permuted view over logical NHD), the whole-cache LBNHC / cross-layer BLNHC and BLHNC buffers seen per
layer, and MLA ``[B, N, C]``. For each: the block dim is found, a page's spans are copied from one cache
into another cache of the same layout, and exactly that block's values (every layer, K and V) arrive."""

from __future__ import annotations

import ctypes

import pytest

from kvplugins.errors import ConfigError
from kvplugins.layout import PageLayout, block_dim_of, planes_of

torch = pytest.importorskip("torch")
L, B, N, H, C = 3, 6, 4, 2, 8  # layers, blocks, tokens per block, kv heads, head size


def nhd():
    return [torch.zeros(2, B, N, H, C) for _ in range(L)]


def hnd():  # physical [2, B, H, N, C], seen as logical [2, B, N, H, C]
    return [torch.zeros(2, B, H, N, C).permute(0, 1, 3, 2, 4) for _ in range(L)]


def lbnhc():  # one buffer for all layers, layer outermost; K/V packed in the content dim
    buf = torch.zeros(L, B, N, H, 2 * C)
    return [buf[i] for i in range(L)]


def blnhc():  # cross-layer: block outermost, then layer
    buf = torch.zeros(B, L, N, H, 2 * C)
    return [buf[:, i] for i in range(L)]


def blhnc():  # cross-layer HND: physical [B, L, H, N, C2], per layer a logical [B, N, H, C2] view
    buf = torch.zeros(B, L, H, N, 2 * C)
    return [buf[:, i].permute(0, 2, 1, 3) for i in range(L)]


def mla():
    return [torch.zeros(B, N, 64 + 16) for _ in range(L)]


LAYOUTS = {"NHD": nhd, "HND": hnd, "LBNHC": lbnhc, "BLNHC": blnhc, "BLHNC": blhnc, "MLA": mla}


def _block(t, dim: int, b: int):
    return t.select(dim, b)


def _copy_page(src: PageLayout, dst: PageLayout, b: int) -> None:
    s, d = src.spans(b), dst.spans(b)
    assert sum(n for _, n in s) == sum(n for _, n in d) == src.page_bytes
    src_bytes = b"".join(ctypes.string_at(a, n) for a, n in s)
    off = 0
    for a, n in d:
        ctypes.memmove(a, src_bytes[off : off + n], n)
        off += n


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_page_roundtrip_moves_exactly_one_block(name):
    make = LAYOUTS[name]
    src, dst = make(), make()
    dim = block_dim_of(tuple(src[0].shape), B)
    assert dim == (1 if name in ("NHD", "HND") else 0)
    for i, t in enumerate(src):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
    lay_src = PageLayout.from_tensors(src, block_dim=dim)
    lay_dst = PageLayout.from_tensors(dst, block_dim=dim)
    per_layer = src[0].numel() // B * src[0].element_size()
    assert lay_src.page_bytes == L * per_layer and lay_src.num_blocks == B
    _copy_page(lay_src, lay_dst, 4)
    for s, d in zip(src, dst):
        assert torch.equal(_block(d, dim, 4), _block(s, dim, 4))  # every value of block 4 arrived
        others = [b for b in range(B) if b != 4]
        assert all(not _block(d, dim, b).any() for b in others)  # and nothing else was written


def test_cross_layer_plane_strides_over_all_layers():
    planes = planes_of(blnhc()[1], block_dim=0)
    assert len(planes) == 1 and planes[0].block_stride == L * planes[0].block_bytes


def test_heads_outside_blocks_is_refused():
    buf = torch.zeros(H, B, N, C)  # LHBNC-like: a block is H separate runs
    with pytest.raises(ConfigError, match="not contiguous"):
        planes_of(buf.permute(1, 2, 0, 3), block_dim=0)


def test_block_dim_not_found_raises():
    with pytest.raises(ConfigError, match="indexes 7 blocks"):
        block_dim_of((2, 6, 4), 7)
