"""RL weight updates into running SGLang engines over kvplugins.p2p (issue #36), through SGLang's own
``update_weights_from_tensor`` entry point with a custom weight loader: the trainer sends a small spec instead of
the tensors, and every engine worker pulls the round's weights peer-to-peer (the workers that hold it serve it on).

Lifecycle, in call order:
  1. SGLang launched with ``--custom-weight-loader kvplugins.sglang_weight_update.load`` (SGLang calls only the
     loaders named there).
  2. Trainer, each round::

         with publisher.round(model.named_parameters()) as named_tensors:
             engine.update_weights_from_tensor(named_tensors, load_format=LOADER)

     ``Publisher(etcd)`` registers the round's tensors as one P2P object (contiguous host tensors are not copied;
     device tensors are copied to the host once) and yields one named tensor, ``SPEC``, carrying the round's
     spec (catalog, object name, ``[name, dtype, shape]`` per weight) as JSON bytes. When the block returns, the
     catalog must list ``workers`` engine workers holding the whole round (each pulled and loaded it), else the
     round is unregistered and TransferFailed raised: SGLang answers success whatever a custom loader did, so
     this is where a worker that could not pull shows. Then the previous round is unregistered. Raising in the
     block unregisters this round.
  3. Each engine worker (SGLang's WeightUpdater) calls ``load(model, named_tensors)``: the spec checked, the object
     pulled into fresh host tensors (every chunk checked against the trainer's xxh3_64; a corrupt chunk is read
     again from another peer, never loaded), then ``model.load_weights`` (SGLang's, which takes each TP rank's
     share); the worker serves its copy to the others until the next round. A spec that is malformed or a pull
     that fails (etcd or every holder away, a chunk no holder has intact) is logged and the model keeps its
     weights: the engine does not crash for a store that is down (SGLang's update call has no way to fail a
     custom loader but an exception, which would end its scheduler); the Publisher's check reports it.
  4. ``publisher.close()``; the workers' stores close when their process exits.
Source followed: SGLang 0.5.23 srt/model_executor/model_runner_components/weight_updater.py.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvplugins.config import load as load_config
from kvplugins.errors import KVPluginsError, ProtocolError, TransferFailed
from kvplugins.p2p.config import P2PConfig
from kvplugins.p2p.store import P2PStore
from kvplugins.p2p.weights import Receiver, Rounds

log = logging.getLogger(__name__)
LOADER = "kvplugins.sglang_weight_update.load"
SPEC = "kvplugins.p2p"  # the named tensor carrying a round's spec
MAX_SPEC_BYTES = 64 << 20

_receivers: dict[str, Receiver] = {}  # catalog -> this process's receiver
_lock = threading.Lock()


class Publisher:
    """The trainer's side (see the module docstring). ``etcd``: the P2P catalog (etcd://host:port)."""

    def __init__(self, etcd: str, prefix: str = "sglang-weights", chunk_bytes: int = 0):
        self.etcd = etcd
        self.store = P2PStore(load_config(P2PConfig, {"etcd": etcd}))
        self.rounds = Rounds(self.store, prefix, chunk_bytes)

    @property
    def published(self) -> str | None:
        """The last round the engines loaded."""
        return self.rounds.published

    @contextmanager
    def round(
        self, named: Iterable[tuple[str, torch.Tensor]], workers: int
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Publish one round; yields the named tensors to pass to ``update_weights_from_tensor``. ``workers``: the
        engine workers (every TP rank of every engine) that must hold it when the block returns (0: no check).
        Raises TransferFailed when fewer do, StoreError (etcd)."""
        with self.rounds.round(named) as (name, params):
            spec = json.dumps({"etcd": self.etcd, "name": name, "params": params}).encode()
            yield [(SPEC, torch.frombuffer(bytearray(spec), dtype=torch.uint8))]
            held = [p.complete - 1 for p in self.store.list(name) if p.name == name]  # less this trainer
            if workers and (not held or held[0] < workers):
                raise TransferFailed(
                    f"weight update {name}: {held[0] if held else 0} of {workers} engine workers hold it; the "
                    "others kept their weights (their logs say why)"
                )

    def close(self) -> None:
        self.store.close()


def load(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: pull the round ``named_tensors`` names (its one ``SPEC`` tensor) and load
    it with ``model.load_weights``. A malformed spec or a failed pull is logged and nothing is loaded (module
    docstring); what ``model.load_weights`` raises propagates, this worker then no longer holding the round."""
    try:
        spec = _spec(named_tensors)
        receiver = _receiver(spec["etcd"])
        named = receiver.pull(spec["name"], spec["params"])
    except KVPluginsError as e:
        log.error("kvplugins weight update not loaded, the model keeps its weights: %s", e)
        return
    try:
        model.load_weights(named)
    except BaseException:
        receiver.drop(spec["name"])
        raise


def _spec(named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
    if len(named_tensors) != 1 or named_tensors[0][0] != SPEC:
        raise ProtocolError(
            f"kvplugins weight update: expected the one named tensor {SPEC!r} a Publisher round yields, got "
            f"{[n for n, _ in named_tensors][:4]}"
        )
    t = named_tensors[0][1]
    if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() > MAX_SPEC_BYTES:
        raise ProtocolError(f"kvplugins weight update: the spec is a 1-D uint8 tensor of JSON, got {t.dtype} {t.shape}")
    try:
        spec = json.loads(bytes(t.cpu().numpy()))
    except ValueError as e:
        raise ProtocolError(f"kvplugins weight update: the spec is not JSON ({e})") from e
    if not isinstance(spec, dict) or not all(isinstance(spec.get(k), str) for k in ("etcd", "name")):
        raise ProtocolError("kvplugins weight update: the spec needs 'etcd' and 'name' strings and 'params'")
    return spec


def _receiver(etcd: str) -> Receiver:
    with _lock:
        r = _receivers.get(etcd)
        if r is None:
            r = _receivers[etcd] = Receiver(P2PStore(load_config(P2PConfig, {"etcd": etcd})))
        return r


@atexit.register
def _close() -> None:
    with _lock:
        for r in _receivers.values():
            r.close()
        _receivers.clear()
