"""kvplugins/layout/hicache.py, the engine-independent part of the HiCache backend (no SGLang needed)."""

from __future__ import annotations

import pytest

from kvplugins.errors import ConfigError
from kvplugins.layout.hicache import covering_ranges, hicache_keyspace, key_bytes, page_spans


def test_page_spans_split_per_page_and_merge_adjacent_pieces():
    assert page_spans([100, 200, 300, 400], [10, 10, 10, 10], 2) == [[(100, 10), (200, 10)], [(300, 10), (400, 10)]]
    assert page_spans([100, 110, 300, 500], [10, 10, 10, 10], 2) == [[(100, 20)], [(300, 10), (500, 10)]]
    assert page_spans([0, 8, 16], [8, 8, 8], 1) == [[(0, 24)]]


@pytest.mark.parametrize("ptrs,sizes,pages", [([1, 2, 3], [1, 1, 1], 2), ([1, 2], [1], 1), ([1], [1], 0)])
def test_page_spans_reject_metadata_that_does_not_split_into_pages(ptrs, sizes, pages):
    with pytest.raises(ConfigError, match="does not split"):
        page_spans(ptrs, sizes, pages)


def test_covering_ranges_merge_overlaps_and_neighbours():
    assert covering_ranges([(100, 50), (120, 10), (150, 10), (400, 8)]) == [(100, 60), (400, 8)]
    assert covering_ranges([]) == []


def _space(**kw):
    base = dict(
        model="m",
        kv_dtype="torch.bfloat16",
        page_size=64,
        page_bytes=1 << 20,
        pool="mha",
        layout="page_first",
        tp_rank=1,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        shared_across_tp=False,
        io_format="v1",
    )
    return hicache_keyspace(**{**base, **kw})


def test_keyspace_separates_everything_that_shapes_the_bytes():
    spaces = [
        _space(),
        _space(kv_dtype="torch.float8_e4m3fn"),
        _space(layout="layer_first"),
        _space(tp_rank=0),
        _space(pp_rank=1, pp_size=2),
        _space(io_format="flat"),
        _space(page_size=32),
        _space(extra="ns=b"),
    ]
    assert len({s.namespace for s in spaces}) == len(spaces)


def test_mla_ranks_share_one_keyspace():
    assert (
        _space(pool="mla", shared_across_tp=True, tp_rank=0).namespace
        == _space(pool="mla", shared_across_tp=True, tp_rank=1).namespace
    )


def test_key_bytes_are_injective():
    assert len(set(key_bytes(["ab", "6162", "AB", "ab "]))) == 4
