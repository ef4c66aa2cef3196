"""Page spans over real numpy/torch memory: the bytes at the spans are exactly block b of every layer."""

import ctypes
from dataclasses import replace

import numpy as np
import pytest

from kvplugins.errors import ConfigError
from kvplugins.layout import PageLayout, Plane, planes_of


def read(spans):
    return b"".join(ctypes.string_at(a, n) for a, n in spans)


def rand(shape, dtype=np.float16, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_cpu_lbhnc_page_is_block_of_every_layer():
    layers = [rand((8, 2, 32, 64 * 2), seed=i) for i in range(4)]  # [blocks, kv_heads, block, head*2]
    lay = PageLayout.from_tensors(layers)
    assert lay.page_bytes == 4 * 2 * 32 * 128 * 2 and lay.num_blocks == 8
    for b in (0, 5, 7):
        assert read(lay.spans(b)) == b"".join(t[b].tobytes() for t in layers)


def test_nhd_kv_first_gives_two_planes_per_layer():
    layers = [rand((2, 6, 16, 4, 8), seed=i) for i in range(3)]  # [2, blocks, block, heads, head]
    lay = PageLayout.from_tensors(layers, block_dim=1)
    assert len(lay.planes) == 6
    assert read(lay.spans(4)) == b"".join(t[0, 4].tobytes() + t[1, 4].tobytes() for t in layers)


def test_one_buffer_adjacent_runs_merge_into_one_span():
    buf = rand((5, 3, 16))  # block-major buffer holding 3 "layers" per block back to back
    layers = [buf[:, i] for i in range(3)]
    lay = PageLayout.from_tensors(layers)
    assert lay.spans(2) == [(buf[2].ctypes.data, buf[2].nbytes)]
    assert lay.regions() == [(buf.ctypes.data, buf.nbytes)]


def test_regions_are_disjoint_per_tensor():
    a, b = rand((4, 32)), rand((4, 32))
    regions = PageLayout.from_tensors([a, b]).regions()
    assert sorted(regions) == sorted([(a.ctypes.data, a.nbytes), (b.ctypes.data, b.nbytes)])


def test_torch_tensor_zero_copy():
    torch = pytest.importorskip("torch")
    t = torch.arange(4 * 2 * 32 * 8, dtype=torch.bfloat16).reshape(4, 2, 32, 8)
    lay = PageLayout.from_tensors([t])
    t[3].fill_(7.0)  # written after mapping: spans point at the live memory
    assert read(lay.spans(3)) == t[3].contiguous().view(torch.uint8).numpy().tobytes()
    assert lay.spans(3)[0][0] == t[3].data_ptr()


def test_non_contiguous_block_raises():
    t = rand((32, 4, 8)).transpose(1, 0, 2)  # blocks (4) inside an outer dim (32): a block is 32 runs
    with pytest.raises(ConfigError, match="not contiguous"):
        planes_of(t)
    permuted = rand((4, 32, 8)).transpose(0, 2, 1)  # inner dims permuted (HND-style view): still one run
    assert planes_of(permuted)[0].block_bytes == 32 * 8 * permuted.itemsize


def test_bad_block_id_and_bad_input_raise():
    lay = PageLayout.from_tensors([rand((4, 8))])
    with pytest.raises(ConfigError, match="block id 4"):
        lay.spans(4)
    with pytest.raises(ConfigError, match="block_dim 3"):
        planes_of(rand((4, 8)), block_dim=3)
    with pytest.raises(ConfigError, match="cannot map a list"):
        planes_of([1, 2])
    with pytest.raises(ConfigError, match="at least one plane"):
        PageLayout([])


def test_overlapping_plane_raises():
    ok = Plane(base=4096, block_stride=64, block_bytes=64, num_blocks=4)
    with pytest.raises(ConfigError, match="overlap"):
        replace(ok, block_stride=32)
