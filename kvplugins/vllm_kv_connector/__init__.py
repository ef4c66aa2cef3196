"""vLLM adapter: ``KVPluginsConnector``, a KVConnectorBase_V1 loaded through ``kv_connector_module_path``.

    --kv-transfer-config '{"kv_connector":"KVPluginsConnector",
                           "kv_connector_module_path":"kvplugins.vllm_kv_connector",
                           "kv_role":"kv_both","kv_connector_extra_config":{"store":{"master":"HOST:PORT"}}}'

Thin: engine types are translated into kvplugins.layout calls (keys, spans, PageStore, the P/D handover) and
nothing more.
connector.py (the class), scheduler.py / worker.py (its two halves), engine.py (vLLM config -> KeySpace, incl.
the physical KV layout), config.py (``kv_connector_extra_config`` options), metadata.py (scheduler -> worker),
pd.py (P/D params and handshake over layout/handover.py), stats.py (metrics), threads.py (where worker threads
run), plugin.py (the ``vllm.general_plugins`` entry point). Importing this package imports vLLM.
"""

from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
from kvplugins.vllm_kv_connector.connector import KVPluginsConnector, KVPluginsConnectorMetadata

__all__ = ["KVPluginsConnector", "KVPluginsConnectorMetadata", "VllmConnectorConfig"]
