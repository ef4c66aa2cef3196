"""Keys: every config field changes the namespace; keys are deterministic and carry the block hash."""

import dataclasses

import pytest

from kvplugins.errors import ConfigError
from kvplugins.layout import KeySpace, loadable_pages, page_hashes

BASE = KeySpace(
    model="m", kv_dtype="bfloat16", block_size=32, layer_group="l0,l1", tp_rank=0, tp_size=2, page_bytes=65536
)


def test_every_field_changes_the_namespace():
    changed = {
        "model": "m2",
        "kv_dtype": "float16",
        "block_size": 64,
        "layer_group": "l0",
        "tp_rank": 1,
        "tp_size": 4,
        "page_bytes": 32768,
        "extra": "xxhash",
    }
    assert set(changed) == {f.name for f in dataclasses.fields(KeySpace)}
    spaces = {BASE.namespace} | {dataclasses.replace(BASE, **{k: v}).namespace for k, v in changed.items()}
    assert len(spaces) == len(changed) + 1


def test_keys_are_deterministic_and_name_the_hash():
    h = [bytes([i]) * 32 for i in range(3)]
    keys = BASE.keys(h)
    assert keys == KeySpace(**dataclasses.asdict(BASE)).keys(h)
    assert keys[1] == f"{BASE.namespace}/{'01' * 32}"
    assert BASE.for_rank(1).keys(h)[0] != keys[0]


def test_bad_keyspace_raises():
    with pytest.raises(ConfigError, match="TP rank 2"):
        dataclasses.replace(BASE, tp_rank=2)
    with pytest.raises(ConfigError, match="block_size 0"):
        dataclasses.replace(BASE, block_size=0)


def test_page_hashes_take_the_chained_hash_at_each_page_end():
    h = [bytes([i]) for i in range(8)]
    assert page_hashes(h, 16, 16) == h
    assert page_hashes(h, 16, 64) == [h[3], h[7]]
    assert page_hashes(h[:7], 16, 64) == [h[3]]  # a partial page has no hash
    with pytest.raises(ConfigError, match="multiple"):
        page_hashes(h, 16, 40)


@pytest.mark.parametrize(
    "tokens,want",
    [
        (321, 10),  # 10 full pages of 32; token 320 is left to compute
        (320, 9),  # exactly 10 pages: the last token must be computed, so 9
        (33, 1),
        (32, 0),
        (10, 0),  # shorter than one page
        (0, 0),
    ],
)
def test_loadable_pages(tokens, want):
    assert loadable_pages(tokens, 32) == want
