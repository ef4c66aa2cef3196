"""Model weights as P2P objects: what both engines' RL weight-update adapters share (kvplugins/vllm_weight_transfer/,
kvplugins/sglang_weight_update/). A round's weights are one object whose buffers are the tensors in order; the
receiver learns their names, dtypes and shapes as ``params`` (``[name, dtype, shape]`` each, dtype as torch
names it without the prefix, e.g. "bfloat16") and pulls into fresh host tensors of exactly that layout.

Publisher: ``Rounds(store, prefix, chunk_bytes)``, then per round ``with rounds.round(named) as (name, params):``
tell the engines (tensors registered, not copied, when they are contiguous host tensors; device tensors copied to
the host once; the round unregistered when the block raises, the previous one once it returns). Receiver:
``Receiver(store)`` -> ``pull(name, params)`` -> [(name, tensor)] per round (the previous round's replica dropped,
this one served on to the other receivers until the next) -> ``close()``.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
import torch

from kvplugins.errors import ProtocolError
from kvplugins.p2p.store import P2PStore

log = logging.getLogger(__name__)
MAX_PARAMS = 1 << 20


def host_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, contiguous in host memory (device tensors copied once; contiguous host ones as they are)."""
    for name, t in named:
        t = t.detach()
        yield name, (t if t.device.type == "cpu" else t.to("cpu")).contiguous()


Params = list[list[object]]  # [name, dtype, shape] per weight, as JSON carries them


def publish(store: P2PStore, name: str, named: list[tuple[str, torch.Tensor]], chunk_bytes: int = 0) -> Params:
    """Register host tensors ``named`` (host_tensors' output) as object ``name``; returns their params."""
    params: Params = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in named]
    store.register(name, [t.view(-1).view(torch.uint8) for _, t in named if t.numel()], chunk_bytes)
    return params


class Rounds:
    """A trainer's rounds, each one object ``{prefix}/{tag}/r{n}`` (``tag`` random per trainer)."""

    def __init__(self, store: P2PStore, prefix: str, chunk_bytes: int = 0):
        self.store, self.prefix, self.chunk_bytes = store, prefix, chunk_bytes
        self.tag, self.count = secrets.token_hex(4), itertools.count(1)
        self.published: str | None = None

    @contextmanager
    def round(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Params]]:
        """Register ``named`` as the next round; yields (its name, its params) for the engines."""
        name = f"{self.prefix}/{self.tag}/r{next(self.count)}"
        params = publish(self.store, name, list(host_tensors(named)), self.chunk_bytes)
        try:
            yield name, params
        except BaseException:
            self.store.unregister(name)
            raise
        if self.published is not None:
            self.store.unregister(self.published)
        self.published = name


def layout(params: object) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``params`` checked (names, torch dtypes, non-negative shapes: a publisher's word, never trusted). Raises
    ProtocolError naming the bad entry."""
    if not isinstance(params, list) or not 0 < len(params) <= MAX_PARAMS:
        raise ProtocolError(f"weight update: params must be a list of 1..{MAX_PARAMS} [name, dtype, shape]")
    out = []
    for row in params:
        try:
            name, dtype_name, shape = row
            dtype = getattr(torch, str(dtype_name))
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError, AttributeError) as e:
            raise ProtocolError(f"weight update: malformed param {row!r:.120}: {e}") from e
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype) or any(d < 0 for d in dims):
            raise ProtocolError(f"weight update: param {row!r:.120} needs a name, a torch dtype and a shape >= 0")
        out.append((name, dtype, dims))
    return out


class Receiver:
    """One engine worker's side: pulls each round into fresh host tensors and serves the last one on."""

    def __init__(self, store: P2PStore):
        self.store = store
        self.serving: str | None = None  # the object pulled last (served until the next round)

    def pull(self, name: str, params: object) -> list[tuple[str, torch.Tensor]]:
        """Object ``name`` as (weight name, host tensor) in params order: every chunk checked against the
        publisher's xxh3_64 (a corrupt chunk is read again from another peer, never returned). Raises
        ProtocolError for malformed params, and as P2PStore.get_replica (nothing is returned then)."""
        shapes = layout(params)
        tensors = [torch.empty(shape, dtype=dtype) for _, dtype, shape in shapes]
        stats = self.store.get_replica(name, [t.view(-1).view(torch.uint8) for t in tensors if t.numel()])
        log.info(
            "weight update %s: %.1f MiB in %.2f s from %d peers", name, stats.bytes / 2**20, stats.seconds,
            len(stats.from_peers),
        )  # fmt: skip
        if self.serving is not None and self.serving != name:
            self.store.delete_replica(self.serving)
        self.serving = name
        return [(n, t) for (n, _, _), t in zip(shapes, tensors)]

    def drop(self, name: str) -> None:
        """Stop serving round ``name`` (pulled, but not loaded: no peer should count this worker as holding it)."""
        if self.serving == name:
            self.store.delete_replica(name)
            self.serving = None

    def close(self) -> None:
        self.store.close()
        self.serving = None
