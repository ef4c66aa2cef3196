"""Reading an SGLang host KV pool (``HostKVCache``): its kind, page geometry, buffers and buffer metadata.

Only the pool's public surface is used: ``kv_buffer`` / ``get_hybrid_pool_buffer()`` (memory to register),
``get_page_buffer_meta(indices)`` (pointers + sizes per page, in the pool's own order), ``page_size``,
``logical_page_size``, ``layout``, ``dtype`` (source: SGLang 0.5.23 ``mem_cache/pool_host``).
"""

from __future__ import annotations

from typing import Any, Sequence

from kvplugins.errors import ConfigError
from kvplugins.layout.hicache import MetaLayout, Span


def pool_kind(pool: Any) -> str:
    """ "mla" for MLA host pools (one latent row per token), else "mha"."""
    return "mla" if hasattr(pool, "kv_lora_rank") else "mha"


def host_buffers(pool: Any) -> list[Span]:
    """(address, nbytes) of every host tensor the pool's buffer metadata can point into."""
    kv = getattr(pool, "kv_buffer", None)
    tensors = [] if isinstance(kv, (list, tuple)) else [kv]  # a Mamba pool's is a list: its hybrid buffers
    get_hybrid = getattr(pool, "get_hybrid_pool_buffer", None)
    if callable(get_hybrid):
        tensors += list(get_hybrid())
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        raise ConfigError(
            f"SGLang host pool {type(pool).__name__} has no KV buffer (a logical-only anchor "
            "pool); kvplugins needs a pool with host KV memory (MHA or MLA host pools)"
        )
    for t in tensors:
        if str(t.device) != "cpu":
            raise ConfigError(f"host pool buffer on {t.device}: kvplugins maps CPU (host) memory only")
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]


def page_tokens(pool: Any) -> int:
    """Token indices per storage page (the logical page: DCP widens it)."""
    return int(getattr(pool, "logical_page_size", pool.page_size))


def page_starts(pool: Any, host_indices: Any, num_keys: int) -> list[int]:
    """First host index of each page of ``host_indices`` (a 1-D int tensor of num_keys * page tokens).
    Raises ValueError (SGLang's rule: raise, never return None) if the lengths disagree."""
    step = page_tokens(pool)
    n = int(host_indices.numel())
    if n != num_keys * step:
        raise ValueError(
            f"host_indices holds {n} token slots for {num_keys} keys; expected "
            f"{num_keys} x page size {step} = {num_keys * step}"
        )
    return [int(i) for i in host_indices[::step].tolist()]


def meta_layout(pool: Any) -> MetaLayout:
    """A layout whose block ids are page start indices; spans come from ``get_page_buffer_meta``."""
    import torch

    step = page_tokens(pool)
    offsets = torch.arange(step, dtype=torch.int64)

    def meta(starts: Sequence[int]):
        indices = (torch.tensor(list(starts), dtype=torch.int64)[:, None] + offsets).flatten()
        return pool.get_page_buffer_meta(indices)

    return MetaLayout(meta, host_buffers(pool))


def page_bytes(pool: Any) -> int:
    """Bytes of one page object in buffer-metadata order (sum of one page's sizes)."""
    import torch

    _, sizes = pool.get_page_buffer_meta(torch.arange(page_tokens(pool), dtype=torch.int64))
    return int(sum(sizes))
