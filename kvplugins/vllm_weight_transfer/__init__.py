"""vLLM's pluggable weight transfer (RL weight updates into a running engine, ``--weight-transfer-config
'{"backend": "kvplugins"}'``) over kvplugins.p2p: the trainer registers each round's weights as one P2P object,
every inference worker pulls it peer to peer (from the trainer and from each other), verified chunk by chunk, and
loads it into its model. ``engine.py`` holds both sides; ``register`` (called by the package's vLLM general
plugin, kvplugins/vllm_kv_connector/plugin.py) adds them to vLLM's two factories under "kvplugins". docs/p2p.md."""

from kvplugins.vllm_weight_transfer.plugin import BACKEND, register

__all__ = ["BACKEND", "register"]
