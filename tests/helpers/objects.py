"""Objects put for a test to read back: ``stored(client, prefix, n, size, seed)``."""

from __future__ import annotations

import numpy as np


def stored(client, prefix: str, n: int, size: int, seed: int):
    """n random ``size``-byte objects put under prefix/i from one registered buffer (asserted to succeed); returns
    (their bytes, a registered zeroed buffer of n objects, the keys)."""
    src = np.random.default_rng(seed).integers(0, 256, n * size, dtype=np.uint8)
    a = client.register_buffer(src).addr
    keys = [f"{prefix}/{i}" for i in range(n)]
    assert client.batch_put_from(keys, [[(a + i * size, size)] for i in range(n)]) == [None] * n
    dst = np.zeros_like(src)
    client.register_buffer(dst)
    return src, dst, keys
