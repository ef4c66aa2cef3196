"""Shared fixtures for the real-engine tests: the demo model, a private store cluster, the demo prompts,
and the page keys of a prompt computed with vLLM's own block hash (as the engine does)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from helpers.cluster import store_cluster  # noqa: E402

from kvplugins.demo.run import DemoConfig, prompts  # noqa: E402
from kvplugins.layout import KeySpace  # noqa: E402

BLOCK = 32


@pytest.fixture(scope="session")
def model() -> str:
    from kvplugins.demo.model import ensure_model
    return str(ensure_model())


@pytest.fixture(scope="session")
def turn_prompts() -> tuple[list[str], list[str]]:
    """(first-turn prompts for engine A, next-turn prompts for engine B), ~1,200 and ~1,700 tokens."""
    return prompts(DemoConfig(conversations=2))


@pytest.fixture(scope="module")
def cluster():
    with store_cluster(nodes=1, segment_size="256MiB") as c:
        yield c


def page_keys(keyspace: dict, token_ids: list[int]) -> list[str]:
    """Keys of the full pages of ``token_ids``: vLLM's chained sha256 block hashes in our key space."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as u
    u.init_none_hash(sha256)
    parent, hashes = None, []
    for i in range(len(token_ids) // BLOCK):
        parent = u.hash_block_tokens(sha256, parent, token_ids[i * BLOCK:(i + 1) * BLOCK], None)
        hashes.append(bytes(parent))
    return KeySpace(**keyspace).keys(hashes)
