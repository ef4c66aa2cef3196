"""vLLM general plugin: registers ``KVPluginsConnector`` with KVConnectorFactory by name, and the "kvplugins"
weight transfer backend (kvplugins/vllm_weight_transfer).

Installed as the ``vllm.general_plugins`` entry point ``kvplugins`` (pyproject.toml), which vLLM loads in every
process (front-end, engine core, workers) before it builds a connector, so
``{"kv_connector":"KVPluginsConnector","kv_role":"kv_both"}`` needs no ``kv_connector_module_path``, and
MultiConnector's lookups by class name (stats, Prometheus metrics) find it. Importing this module does not
import vLLM; ``register`` does. Source followed: vLLM 0.32 vllm/plugins/__init__.py and
kv_connector/factory.py (register_connector).
"""

from __future__ import annotations

NAME = "KVPluginsConnector"
MODULE = "kvplugins.vllm_kv_connector.connector"


def register() -> None:
    """Register the connector under ``NAME``; a second call (vLLM loads plugins once per process, tests may
    load them again) is a no-op."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    except ValueError:  # already registered: by an earlier call in this process
        pass
    from kvplugins.vllm_weight_transfer import register as register_weight_transfer

    register_weight_transfer()  # the "kvplugins" weight transfer backend (RL weight updates over kvplugins.p2p)
