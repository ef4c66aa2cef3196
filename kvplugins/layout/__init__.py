"""Page-first layout: an engine's paged KV tensors seen as one object per block ("page") across all layers.

Engine-independent (no vLLM or SGLang imports):
  spans.py  per-layer planes (base address, block stride, block bytes) -> the (addr, nbytes) spans of a page,
            zero-copy: the spans point into the engine's own KV memory.
  pages.py  PageStore: load/save whole pages zero-copy through a StoreClient, surviving a store outage.
  keys.py   a collision-free key per page: a namespace hashed from everything that shapes the page bytes
            (model, KV dtype, block size, layer group, TP rank/size, page bytes) + the engine's block hash.
"""

from kvplugins.layout.keys import KeySpace, loadable_pages, page_hashes
from kvplugins.layout.pages import PageStore
from kvplugins.layout.spans import PageLayout, Plane, Span, block_dim_of, planes_of

__all__ = [
    "KeySpace",
    "PageLayout",
    "PageStore",
    "Plane",
    "Span",
    "block_dim_of",
    "loadable_pages",
    "page_hashes",
    "planes_of",
]
