"""The segment allocator: first fit, alignment, coalescing, fragmentation (no processes)."""

import random

import numpy as np
import pytest

from kvplugins.store.master.allocator import Allocator


def test_first_fit_aligned_and_exhausts():
    a = Allocator(1024, align=64)
    offs = [a.alloc(10) for _ in range(16)]
    assert offs == [i * 64 for i in range(16)]
    assert a.alloc(1) is None and a.free_bytes == 0


def test_free_coalesces_both_neighbours():
    a = Allocator(64 * 4, align=64)
    x, y, z, w = (a.alloc(64) for _ in range(4))
    a.free(x)
    a.free(z)
    assert a.free_blocks() == 2 and a.largest_free() == 64
    a.free(y)  # joins x and z
    assert a.free_blocks() == 1 and a.largest_free() == 192
    a.free(w)
    assert a.free_blocks() == 1 and a.largest_free() == 256 and a.fragmentation() == 0.0


def test_fragmentation_blocks_large_alloc_until_neighbours_free():
    a = Allocator(64 * 8, align=64)
    offs = [a.alloc(64) for _ in range(8)]
    for o in offs[::2]:
        a.free(o)
    assert a.free_bytes == 256 and a.alloc(128) is None  # 4 holes of 64: fragmented
    assert a.fragmentation() == pytest.approx(0.75)
    a.free(offs[1])
    assert a.alloc(128) == 0  # holes 0,1,2 merged


def test_double_free_raises():
    a = Allocator(256)
    o = a.alloc(64)
    a.free(o)
    with pytest.raises(KeyError):
        a.free(o)


def test_random_churn_keeps_invariants():
    rng = random.Random(7)
    a = Allocator(1 << 16, align=64)
    live = {}
    for _ in range(3000):
        if live and rng.random() < 0.5:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            size = rng.randint(1, 2000)
            off = a.alloc(size)
            if off is not None:
                live[off] = a.rounded(size)
    spans = sorted(live.items())
    assert all(o1 + s1 <= o2 for (o1, s1), (o2, _) in zip(spans, spans[1:]))  # no overlap
    assert a.used_bytes == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.free_blocks() == 1 and a.free_bytes == 1 << 16


def test_alloc_many_is_consecutive_and_frees_per_object():
    a = Allocator(4096, align=64)
    assert a.alloc_many([100, 64, 1]) == [0, 128, 192]  # rounded to 64, back to back
    assert a.used_bytes == 256
    hole = a.alloc(64)  # 256
    a.free(128)  # a 64-byte hole at 128
    assert a.alloc_many([64, 64]) == [320, 384]  # needs one block holding both: not the hole
    assert a.alloc_many([4096]) is None  # no single block holds it
    for off in (0, 192, hole, 320, 384):
        a.free(off)
    assert a.free_blocks() == 1 and a.used_bytes == 0  # every piece freed on its own, merged


@pytest.mark.parametrize("kind", [list, lambda x: np.array(x, dtype=np.uint64)], ids=["list", "uint64-array"])
def test_split_run_cuts_back_to_back_pieces_and_keeps_the_rest(kind):
    a = Allocator(1 << 16, align=64)
    slab = a.alloc(4096)  # a slab: one allocation, cut as objects land in it
    assert a.split_run(slab, kind([64, 128])) == 192
    assert [a.size_at(off) for off in (0, 64, 192)] == [64, 128, 3904]  # the rest is one allocation
    with pytest.raises(ValueError, match=r"split_run to 8384: past the allocation \[192, 4096\)"):
        a.split_run(192, kind([8192]))
    assert a.size_at(192) == 3904  # nothing cut
    with pytest.raises(KeyError):
        a.split_run(100, kind([64]))  # no allocation starts there
    assert a.split_run(192, kind([3904])) == 4096 and a.size_at(192) == 3904  # exactly the rest: no remainder
    for off in (0, 64, 192):
        a.free(off)
    assert a.free_blocks() == 1 and a.used_bytes == 0


def test_claim_takes_exactly_the_free_bytes_of_a_range():
    a = Allocator(1024, align=64)
    x, y = a.alloc(128), a.alloc(128)  # [0, 128) [128, 256)
    a.free(x)  # free: [0, 128), [256, 1024)
    got = a.claim(64, 512)  # the free parts inside: [64, 128) and [256, 512)
    assert got == [64, 256] and [a.size_at(o) for o in got] == [64, 256]
    assert a.used_bytes == 128 + 64 + 256 and a.free_blocks() == 2  # [0, 64) and [512, 1024) left
    assert a.claim(0, 1024) == [0, 512] and a.free_bytes == 0
    assert a.claim(0, 1024) == []
    for off in [64, 256, 0, 512, y]:
        a.free(off)
    assert a.used_bytes == 0 and a.alloc(1024) == 0  # everything coalesced back
