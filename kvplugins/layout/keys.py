"""Store keys for pages: ``<namespace>/<hex of the engine's block hash>``.

The namespace hashes (blake2b, 16 bytes) every setting that shapes a page's bytes, so two configurations
can never read each other's pages: model id, KV dtype, block size (tokens per page), layer group (its
layer names), TP rank and TP world size, page bytes, and a free-form ``extra`` (e.g. the engine's hash
algorithm). The block hash is the engine's content hash of the token prefix ending at that block
(vLLM: ``request.block_hashes``, chained, so a key names a whole prefix, not just one block's tokens).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Sequence

from kvplugins.errors import ConfigError

KEY_FORMAT = 1  # bump when the page byte layout changes


@dataclass(frozen=True)
class KeySpace:
    """Everything that must match for two engines to share a page. Sizes: block_size in tokens,
    page_bytes in bytes. layer_group: a stable description of the layers in one page (e.g. their names)."""

    model: str
    kv_dtype: str
    block_size: int
    layer_group: str
    tp_rank: int
    tp_size: int
    page_bytes: int
    extra: str = ""

    def __post_init__(self):
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"TP rank {self.tp_rank} outside world size {self.tp_size}")
        if self.block_size <= 0 or self.page_bytes <= 0:
            raise ConfigError(f"block_size {self.block_size} and page_bytes {self.page_bytes} must be > 0")

    @property
    def namespace(self) -> str:
        """``kvp<format>-<32 hex>``: blake2b-128 of the canonical JSON of every field."""
        blob = json.dumps({"format": KEY_FORMAT, **asdict(self)}, sort_keys=True).encode()
        return f"kvp{KEY_FORMAT}-{hashlib.blake2b(blob, digest_size=16).hexdigest()}"

    def for_rank(self, tp_rank: int) -> "KeySpace":
        """The same key space seen by another TP rank."""
        return KeySpace(**{**asdict(self), "tp_rank": tp_rank})

    def keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        """One key per block hash (bytes, any length), in order."""
        ns = self.namespace
        return [f"{ns}/{bytes(h).hex()}" for h in block_hashes]


def page_hashes(block_hashes: Sequence[bytes], hash_block_size: int, block_size: int) -> list[bytes]:
    """The hash of each full page when the engine hashes every ``hash_block_size`` tokens and a page holds
    ``block_size`` tokens: the chained hash at the end of each page names the whole prefix up to it.
    Raises ConfigError if block_size is not a multiple of hash_block_size."""
    if hash_block_size <= 0 or block_size % hash_block_size:
        raise ConfigError(f"block size {block_size} is not a multiple of the hash block size {hash_block_size}")
    step = block_size // hash_block_size
    return list(block_hashes[step - 1 :: step])


def loadable_pages(num_tokens: int, block_size: int) -> int:
    """Most leading pages of a ``num_tokens`` prompt worth loading: the engine must compute at least the last
    token itself (it samples from it), so the loaded prefix ends before token ``num_tokens - 1``."""
    return max(0, (num_tokens - 1) // block_size)
