"""Registers the "kvplugins" weight transfer backend with vLLM's WeightTransferEngineFactory (the workers' side)
and WeightTransferTrainerFactory (the trainer's), lazily: importing this module does not import vLLM. Source
followed: vLLM 0.32 vllm/distributed/weight_transfer/factory.py."""

from __future__ import annotations

BACKEND = "kvplugins"
MODULE = "kvplugins.vllm_weight_transfer.engine"


def register() -> None:
    """Register both sides under BACKEND; a second call is a no-op. A trainer process that does not run vLLM's
    plugin loader calls this (or ``vllm.plugins.load_general_plugins()``) before ``trainer_init``."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in (
        (WeightTransferEngineFactory, "KVPluginsWeightTransferEngine"),
        (WeightTransferTrainerFactory, "KVPluginsTrainerWeightTransferEngine"),
    ):
        try:
            factory.register_engine(BACKEND, MODULE, cls)
        except ValueError:  # registered by an earlier call in this process
            pass
