"""Per-page byte spans over an engine's paged KV memory (no copies).

A layer's KV memory is described by one or more *planes*. A plane holds, for every block id ``b``, one
contiguous run of ``block_bytes`` bytes at ``base + b * block_stride``. Examples (``L`` = block_size tokens):
  vLLM CPU   ``[num_blocks, kv_heads, L, head_size*2]``       -> 1 plane (block dim first, rest dense)
  NHD        ``[2, num_blocks, L, kv_heads, head_size]``      -> 2 planes (K, V)
  HND        ``[2, num_blocks, kv_heads, L, head_size]``      -> 2 planes (K, V)
  MLA        ``[num_blocks, L, kv_lora_rank + rope_dim]``     -> 1 plane
  cross-layer (vLLM KVCacheLayout BLNHC/BLHNC: blocks outermost, then layers): each layer's view is one plane
  whose ``block_stride`` spans every layer's block
  (HND is usually a permuted view of a logical NHD shape: a block is still one dense run, in memory order)
A page (block ``b`` of every layer, "page-first") is the concatenation of each plane's run in plane order,
so a page object in the store is ``sum(plane.block_bytes)`` bytes. Adjacent runs are merged into one span.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from kvplugins.errors import ConfigError

Span = tuple[int, int]  # (address, nbytes)


@dataclass(frozen=True)
class Plane:
    """One contiguous run per block: block ``b`` is ``block_bytes`` bytes at ``base + b * block_stride``.

    base, block_stride, block_bytes: bytes. num_blocks: blocks the plane holds (ids 0..num_blocks-1).
    device: where the bytes live ('cpu', 'cuda:0', ...): only CPU planes are addressed by the transfer core
    directly; device planes are staged through host memory (layout/staged.py). source: the tensor or array
    the plane was cut from (kept for staging; not part of equality).
    """

    base: int
    block_stride: int
    block_bytes: int
    num_blocks: int
    device: str = "cpu"
    source: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.block_bytes <= 0 or self.num_blocks <= 0:
            raise ConfigError(f"plane {self}: block_bytes and num_blocks must be > 0")
        if self.num_blocks > 1 and abs(self.block_stride) < self.block_bytes:
            raise ConfigError(
                f"plane {self}: block_stride {self.block_stride} B < block_bytes "
                f"{self.block_bytes} B, so blocks overlap; describe the tensor with its block dim"
            )


def _geometry(t: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int, str]:
    """(data address, shape, strides in bytes, itemsize, device) of a torch tensor or a numpy array."""
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):  # torch.Tensor, without importing torch
        item = t.element_size()
        device = str(getattr(t, "device", "cpu"))
        return t.data_ptr(), tuple(t.shape), tuple(s * item for s in t.stride()), item, device
    if hasattr(t, "__array_interface__"):  # numpy.ndarray
        return t.ctypes.data, tuple(t.shape), tuple(t.strides), t.itemsize, "cpu"
    raise ConfigError(f"cannot map a {type(t).__name__}; pass a torch tensor or a numpy array")


def planes_of(tensor: Any, block_dim: int = 0) -> list[Plane]:
    """The planes of one layer's KV tensor whose dimension ``block_dim`` indexes blocks.

    Dimensions before ``block_dim`` (e.g. the K/V dim of NHD/HND) become separate planes in index order;
    dimensions after it must tile one dense run of bytes in some order (a permuted view such as vLLM's HND
    over a logical NHD shape is fine: the page holds the block's bytes in memory order), since one block
    must be one run of bytes.
    tensor: torch tensor (any device: device planes are staged, layout/staged.py) or numpy array, any dtype.
    Raises ConfigError for other objects or a layout whose block is not contiguous (the message names the shape
    and strides).
    """
    addr, shape, strides, item, device = _geometry(tensor)
    if not 0 <= block_dim < len(shape):
        raise ConfigError(f"block_dim {block_dim} out of range for a tensor of shape {shape}")
    inner = shape[block_dim + 1 :]
    expect = item  # the dims after the block dim, in memory order (any permutation), must tile one dense run
    for stride, size in sorted((st, sz) for sz, st in zip(inner, strides[block_dim + 1 :]) if sz != 1):
        if stride != expect:
            raise ConfigError(
                f"KV tensor shape {shape} strides {strides} B: the dims after block dim "
                f"{block_dim} do not form one dense run of bytes, so a block is not contiguous "
                "(e.g. a layout with heads outside blocks); this layout is not supported"
            )
        expect *= size
    block_bytes = math.prod(inner) * item
    outer = shape[:block_dim]
    planes = []
    for idx in _indices(outer):
        base = addr + sum(i * s for i, s in zip(idx, strides))
        planes.append(Plane(base, strides[block_dim], block_bytes, shape[block_dim], device, tensor))
    return planes


def head_planes(tensor: Any, block_dim: int, heads: int, head: int) -> list[Plane] | None:
    """The planes of KV head ``head`` of the ``heads`` a layer's KV tensor holds: that head's run in every
    block, e.g. ``[2, num_blocks, heads, L, head_size]`` (HND: vLLM CPU's LBHNC) -> 2 planes (K, V) of
    ``L * head_size`` elements per block. The head dim is the first dim after ``block_dim`` of size ``heads``.
    None when a head's part of a block is not one dense run, or is cut per token (NHD: heads inside tokens),
    or no dim holds the heads: such a layout stores whole pages per TP rank instead. tensor: a torch tensor (uses select/movedim)."""
    shape = tuple(tensor.shape)
    dims = [d for d in range(block_dim + 1, len(shape)) if shape[d] == heads]
    if not dims or not hasattr(tensor, "select") or not 0 <= head < heads:
        return None
    if math.prod(shape[block_dim + 1 : dims[0]]) > 2:  # only K/V may sit between blocks and heads: NHD's
        return None  # tokens there would cut a head into a run per token
    view = tensor.select(dims[0], head)  # dims between the block dim and the head dim become planes
    view = view.movedim(block_dim, dims[0] - 1)  # (e.g. K/V inside a block): move the block dim after them
    try:
        return planes_of(view, dims[0] - 1)
    except ConfigError:
        return None


def block_dim_of(shape: Sequence[int], num_blocks: int) -> int:
    """The dim of a KV tensor of ``shape`` that indexes the engine's ``num_blocks`` blocks: the first dim of
    exactly that size, else the first whose size is a multiple of it (a kernel splitting engine blocks).
    E.g. 0 for CPU/FlashInfer/MLA ``[num_blocks, ...]``, 1 for FlashAttention ``[2, num_blocks, ...]``.
    Raises ConfigError when no dim fits."""
    for d, size in enumerate(shape):
        if size == num_blocks:
            return d
    for d, size in enumerate(shape):
        if size >= num_blocks > 0 and size % num_blocks == 0:
            return d
    raise ConfigError(f"no dim of KV tensor shape {tuple(shape)} indexes {num_blocks} blocks")


def _indices(shape: Sequence[int]) -> Iterable[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (i, *rest)


def zero_spans(spans: Iterable[Span]) -> None:
    """Write zeros over each (address, nbytes) span (host memory this process owns)."""
    for addr, nbytes in spans:
        ctypes.memset(addr, 0, nbytes)


class PageLayout:
    """All planes of a layer group, in page order (layer order, then plane order within a layer).

    page_bytes: bytes of one page object. num_blocks: block ids valid here (the smallest plane's count).
    """

    def __init__(self, planes: Sequence[Plane]):
        if not planes:
            raise ConfigError("a page layout needs at least one plane (no KV tensors were given)")
        devices = sorted({p.device for p in planes})
        if len(devices) > 1:
            raise ConfigError(f"KV tensors on several devices {devices}: one page layout covers one device")
        self.planes = tuple(planes)
        self.device = devices[0]
        self.page_bytes = sum(p.block_bytes for p in self.planes)
        self.num_blocks = min(p.num_blocks for p in self.planes)

    @classmethod
    def from_tensors(cls, tensors: Iterable[Any], block_dim: int = 0) -> "PageLayout":
        """Layout of per-layer KV tensors given in layer order (see planes_of)."""
        return cls([p for t in tensors for p in planes_of(t, block_dim)])

    def spans(self, block_id: int) -> list[Span]:
        """The (address, nbytes) spans of page ``block_id``, adjacent runs merged; sum(nbytes) == page_bytes.
        Raises ConfigError for a block id outside 0..num_blocks-1."""
        if not 0 <= block_id < self.num_blocks:
            raise ConfigError(f"block id {block_id} outside the KV cache (0..{self.num_blocks - 1})")
        out: list[list[int]] = []
        for p in self.planes:
            addr = p.base + block_id * p.block_stride
            if out and out[-1][0] + out[-1][1] == addr:
                out[-1][1] += p.block_bytes
            else:
                out.append([addr, p.block_bytes])
        return [(a, n) for a, n in out]

    def spans_for(self, block_ids: Iterable[int]) -> list[list[Span]]:
        """spans(b) for each block id, in order."""
        return [self.spans(b) for b in block_ids]

    def regions(self) -> list[Span]:
        """The disjoint (address, nbytes) ranges covering every page, overlapping/adjacent ranges merged:
        the memory to register with a transfer engine (one registration per range). Raises ConfigError for
        device memory (staged instead: layout/staged.py)."""
        if self.device != "cpu":
            raise ConfigError(
                f"KV memory on {self.device} cannot be registered with the transfer core; "
                "stage it through host memory (PageStore(staging=...))"
            )
        ranges = sorted(
            (
                p.base + min(0, (p.num_blocks - 1) * p.block_stride),
                abs((p.num_blocks - 1) * p.block_stride) + p.block_bytes,
            )
            for p in self.planes
        )
        out: list[list[int]] = []
        for a, n in ranges:
            if out and a <= out[-1][0] + out[-1][1]:
                out[-1][1] = max(out[-1][1], a + n - out[-1][0])
            else:
                out.append([a, n])
        return [(a, n) for a, n in out]
