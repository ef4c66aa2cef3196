"""vLLM config -> the engine-independent description kvplugins.layout needs (KeySpace, layer order)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvplugins.errors import ConfigError
from kvplugins.layout import KeySpace
from kvplugins.layout.shards import rank_heads
from kvplugins.vllm_kv_connector.config import VllmConnectorConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class Group:
    """One KV cache group this connector serves (vLLM's ``kv_cache_config.kv_cache_groups[index]``).

    ``window_blocks``: 0 for full attention (a hit needs every page of the prefix); for sliding window the
    pages a hit needs before its end, as vLLM's own prefix cache counts them (SlidingWindowManager:
    ``cdiv(sliding_window - 1, block_size)``, vLLM 0.32 v1/core/single_type_kv_cache_manager.py).
    ``state``: a Mamba / linear-attention group in vLLM's "align" prefix-caching mode. Its block at page p holds
    the recurrent state after tokens [0, (p + 1) * block_size), so a hit ending at page ``end`` needs only page
    ``end - 1`` (window_blocks = 1), as MambaManager.find_longest_cache_hit counts it; those pages are saved
    only from the exact blocks vLLM hands over (``boundary_state_offloads``), never read positionally.
    With ``layer_chunks`` > 1 a Group is one chunk of consecutive layers of KV cache group ``index``: its own
    page objects (keys), the same block ids and hit rule as its KV cache group.
    ``replicated``: every TP rank holds the same bytes (MLA's latent KV): its key space leaves the TP rank and
    size out, TP rank 0 writes, every rank reads, so the pool holds one copy at any TP size (as SGLang HiCache's
    MLA writer rank and LMCache's first-rank MLA save)."""

    index: int
    layer_names: tuple[str, ...]
    spec: Any
    window_blocks: int = 0
    uid: int = 0  # position in the connector's list (keys its PageStore and PageBatch.groups)
    state: bool = False
    replicated: bool = False

    def needed(self, first: int, end: int) -> range:
        """The pages in [first, end) a hit ending at page ``end`` needs from this group."""
        return range(max(first, end - self.window_blocks) if self.window_blocks else first, end)


def groups(kv_cache_config: "KVCacheConfig", layer_chunks: int = 1) -> list[Group]:
    """The KV cache groups, in vLLM's order: full-attention (MLA included), sliding-window and Mamba / linear-
    attention ("align" mode) ones, all with one block size; each cut into ``min(layer_chunks, its layers)``
    chunks of consecutive layers (see Group). Raises ConfigError naming any other kind (chunked local
    attention), a Mamba group outside "align" mode (the fix: prefix caching on), or differing block sizes."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    out, other = [], []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            out.append(Group(i, tuple(g.layer_names), spec, -(-(spec.sliding_window - 1) // spec.block_size)))
        elif isinstance(spec, FullAttentionSpec):
            out.append(Group(i, tuple(g.layer_names), spec, replicated=isinstance(spec, MLAAttentionSpec)))
        elif isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
            out.append(Group(i, tuple(g.layer_names), spec, window_blocks=1, state=True))
        elif isinstance(spec, MambaSpec):
            raise ConfigError(
                f"KVPluginsConnector: KV cache group {i} is {spec.mamba_type} state with "
                f"mamba_cache_mode={spec.mamba_cache_mode!r}; its state is saved per block only in "
                "'align' mode: start vLLM with --enable-prefix-caching (and --mamba-cache-mode align)"
            )
        else:
            other.append(f"group {i}: {type(spec).__name__}")
    if other or not out:
        raise ConfigError(
            f"KVPluginsConnector serves full-attention, sliding-window and Mamba/linear-attention "
            f"KV cache groups; this model has {other or 'none'}: run it without the connector"
        )
    sizes = sorted({g.spec.block_size for g in out})
    if len(sizes) > 1:
        raise ConfigError(f"KVPluginsConnector: KV cache groups with block sizes {sizes} tokens; it needs one")
    chunks = [replace(g, layer_names=names) for g in out for names in _chunks(g.layer_names, layer_chunks)]
    return [replace(g, uid=i) for i, g in enumerate(chunks)]


def whole_request_failure(groups: list[Group]) -> bool:
    """True when a failed load must fail whole requests (vLLM's ``failed_recving``: the request computes from
    its first token) rather than hand back failed block ids (``invalid_block_ids``: vLLM recomputes from the
    first failed block on, trusting every block before it). The block path is right only for one full-attention
    KV cache group: with several groups vLLM refuses it, and a sliding-window or state group never loaded the
    pages before its window, so recomputing from a failed page inside the window would attend to KV that is
    not there (wrong tokens, issue #30 item 9)."""
    return len({g.index for g in groups}) > 1 or any(g.window_blocks or g.state for g in groups)


def _chunks(names: tuple[str, ...], n: int) -> list[tuple[str, ...]]:
    """``names`` cut into min(n, len(names)) runs of consecutive layers, sizes differing by at most one."""
    n = min(n, len(names))
    q, r = divmod(len(names), n)
    bounds = [i * q + min(i, r) for i in range(n + 1)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def keyspace(
    vllm_config: "VllmConfig",
    kv_cache_config: "KVCacheConfig",
    cfg: VllmConnectorConfig,
    tp_rank: int = 0,
    group: Group | None = None,
) -> KeySpace:
    """The KeySpace of ``group`` (default: the first) on TP rank ``tp_rank``: model, KV dtype, block size, the
    group's layer names (so two groups never share a key; a PP stage's are its own layers, so each stage has
    its own pages), TP rank and size (TP rank 0 of 1 for a replicated group: one copy whatever the TP size),
    page bytes. A model with one full-attention group keeps the keys it had before hybrid models were served."""
    par = vllm_config.parallel_config
    group = group or groups(kv_cache_config)[0]
    rank, size = (0, 1) if group.replicated else (tp_rank, par.tensor_parallel_size)
    spec = group.spec
    cache = vllm_config.cache_config
    if group.state:  # a state's bytes: its tensors (conv, ssm...) without vLLM's page padding
        dtype = ",".join(str(d).removeprefix("torch.") for d in spec.dtypes)
        page, quant = spec.real_page_size_bytes, "none"
        kind = getattr(spec.mamba_type, "name", spec.mamba_type)  # e.g. SHORT_CONV, GDN_ATTN, MAMBA2
        layout = f"state:{kind}:{'/'.join('x'.join(map(str, s)) for s in spec.shapes)}"
    else:
        dtype, page, quant = str(spec.dtype).removeprefix("torch."), spec.page_size_bytes, spec.kv_quant_mode
        layout = physical_layout(vllm_config, kv_cache_config, group.layer_names)
    return KeySpace(
        model=cfg.model_id or vllm_config.model_config.model,
        kv_dtype=dtype,
        block_size=spec.block_size,
        layer_group=",".join(group.layer_names),
        tp_rank=rank,
        tp_size=size,
        page_bytes=page * len(group.layer_names),
        extra=f"hash={cache.prefix_caching_hash_algo};kv_quant={quant};layout={layout}",
    )


def rank_spaces(
    vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cfg: VllmConnectorConfig, tp_rank: int, group: Group
) -> tuple[list[KeySpace], bool]:
    """(the key spaces TP rank ``tp_rank`` moves ``group``'s pages in, whether it writes them): one per KV head
    it holds when the group is stored per head (``per_head``: key space "TP rank h of TP size = KV heads",
    layout/shards.py), else its own. A replicated (MLA) group: the one space, written by TP rank 0; a head
    held by several ranks (TP > KV heads): written by the first."""
    ks = keyspace(vllm_config, kv_cache_config, cfg, tp_rank, group)
    if group.replicated:
        return [ks], tp_rank == 0
    total = vllm_config.model_config.get_total_num_kv_heads()
    if not per_head(group, ks) or not total:
        return [ks], True
    h = rank_heads(tp_rank, vllm_config.parallel_config.tensor_parallel_size, total)
    return [
        replace(ks, tp_rank=h.first + j, tp_size=h.heads, page_bytes=ks.page_bytes // h.count) for j in range(h.count)
    ], h.writes


def per_head(group: Group, ks: KeySpace) -> bool:
    """Whether ``group`` (key space ``ks``) is stored per KV head: an attention group (not MLA, not a state)
    whose KV layout keeps each head's part of a block in one run of bytes (``*HNC``: vLLM CPU's LBHNC, HND,
    cross-layer BLHNC). NHD-style layouts (heads inside tokens) keep one object per TP rank."""
    layout = ks.extra.rsplit("layout=", 1)[-1]
    return (
        not group.replicated
        and not group.state
        and bool(getattr(group.spec, "num_kv_heads", 0))
        and layout.endswith("HNC")
    )


def required_spaces(
    vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cfg: VllmConnectorConfig, group: Group
) -> list[KeySpace]:
    """Every key space a hit on ``group`` needs, over all TP ranks of this PP stage (distinct, in order)."""
    out: list[KeySpace] = []
    for r in range(vllm_config.parallel_config.tensor_parallel_size):
        out += [k for k in rank_spaces(vllm_config, kv_cache_config, cfg, r, group)[0] if k not in out]
    return out


def physical_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", layer_names=None) -> str:
    """How a page's bytes are arranged in memory: ``<attention backend>:<KV cache layout>``, e.g.
    ``CPU_ATTN:LBHNC`` or ``FLASH_ATTN:LBNHC`` (vLLM's KVCacheLayout names; the legacy NHD/HND aliases map to
    LBNHC/LBHNC). It is part of the key namespace, so two engines whose backends or layouts differ never read
    each other's pages as wrong bytes (they miss instead). The layout is the one the engine core resolved
    (``KVCacheConfig.kv_cache_layout``, else ``cache_config.kv_cache_layout``); before it is resolved, the
    backend's preferred layout. Source followed: vLLM 0.32 vllm/v1/kv_cache_layout.py and
    kv_connector/utils.get_current_attn_backend."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backend

    names = list(layer_names or groups(kv_cache_config)[0].layer_names)
    backend = get_current_attn_backend(vllm_config, names)
    name = getattr(kv_cache_config, "kv_cache_layout", None) or vllm_config.cache_config.kv_cache_layout
    if name is None:
        supported = backend.supported_kv_cache_layouts() or ()
        return f"{backend.get_name()}:{supported[0].name if supported else 'default'}"
    return f"{backend.get_name()}:{_LAYOUT_ALIASES.get(name, name)}"


_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vLLM's legacy names (config/cache.py)


def hash_block_size(kv_cache_config: "KVCacheConfig", block_size: int) -> int:
    """Tokens per entry of request.block_hashes (vLLM may hash at a finer grain than its blocks)."""
    return kv_cache_config.hash_block_size or block_size
