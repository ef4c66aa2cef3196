"""Page keys of a prompt as the engine names them: vLLM's own chained sha256 block hashes in our key space."""
from __future__ import annotations

from kvplugins.layout import KeySpace

BLOCK = 32  # tokens per KV block in every engine the tests start


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
