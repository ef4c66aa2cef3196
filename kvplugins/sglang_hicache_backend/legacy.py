"""SGLang's legacy page IO (``get``/``set``/``batch_get``/``batch_set``): flat page tensors, one copy each way.

Used when ``interface_v1`` is off (the controller's ``_generic_page_get``/``_generic_page_set``): a page is the
host pool's ``get_data_page(index, flat=True)`` tensor, stored under the "flat" key space, whose byte order
differs from the zero-copy objects for layer_first pools — so the two never share keys.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from kvplugins.layout.hicache import KeyedPageStore, key_bytes
from kvplugins.layout.keys import KeySpace

log = logging.getLogger(__name__)


def _bytes_view(t: Any) -> memoryview:
    """The bytes of a CPU tensor (made contiguous) as a read-only memoryview."""
    import torch

    return memoryview(t.detach().contiguous().view(torch.uint8).numpy()).cast("B")


def batch_get(store: KeyedPageStore, space: KeySpace, keys: Sequence[str], targets: Any) -> list:
    """Each stored page copied into ``targets[i]`` (a flat CPU tensor of the page's size) and returned; None for
    a miss, a size mismatch, or an unreachable store. targets None: new uint8 tensors are returned."""
    import torch

    names = space.keys(key_bytes(keys))
    datas = store.call(lambda c: c.batch_get(names), [None] * len(names))
    out = []
    for i, data in enumerate(datas):
        if not isinstance(data, (bytes, bytearray)):
            out.append(None)
            continue
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dst = targets[i] if targets is not None and targets[i] is not None else None
        if dst is None:
            out.append(src)
        elif dst.numel() * dst.element_size() != src.numel():
            log.warning(
                "kvplugins: page %s is %d B, the target holds %d B; treated as a miss",
                keys[i],
                src.numel(),
                dst.numel() * dst.element_size(),
            )
            out.append(None)
        else:
            dst.view(torch.uint8).view(-1).copy_(src)
            out.append(dst)
    return out


def batch_set(store: KeyedPageStore, space: KeySpace, keys: Sequence[str], values: object) -> bool:
    """Store each flat page tensor under its key (existing keys are kept); True if all are stored now.
    Never raises: a failure is logged and gives False."""
    names = space.keys(key_bytes(keys))
    try:
        datas = [_bytes_view(v) for v in values]
    except Exception as e:  # noqa: BLE001 - never raise into SGLang's backup thread
        log.error("kvplugins: legacy batch_set got values it cannot read as CPU tensors: %r", e)
        return False
    errors = store.call(lambda c: c.batch_put(names, datas), None)
    if errors is None:
        return False
    store.track([n for n, e in zip(names, errors) if e is None])
    bad = [e for e in errors if e is not None]
    if bad:
        log.warning("kvplugins: %d of %d legacy page saves failed: %s", len(bad), len(names), bad[0])
    return not bad
