"""Block hashes for page tests: ``n`` distinct 32-byte hashes per ``salt`` (an engine's chained hashes stand-in)."""

from __future__ import annotations


def block_hashes(n: int, salt: int) -> list[bytes]:
    return [bytes([salt, i]) * 16 for i in range(n)]
