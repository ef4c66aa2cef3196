"""kvplugins: a shared, multi-node KV-cache pool for SGLang and vLLM, and CPU-resident MoE experts.

Importing this package is cheap (no torch, no zmq, no native module): subpackages load on first use.
Map of the code: docs/architecture.md.
"""

__version__ = "0.1.0"

from kvplugins.errors import KVPluginsError  # noqa: E402  (errors is stdlib-only)

__all__ = ["KVPluginsError", "__version__"]
