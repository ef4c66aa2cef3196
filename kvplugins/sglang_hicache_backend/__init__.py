"""SGLang HiCache L3 storage backend on the kvplugins store.

    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name":"kvplugins",
        "module_path":"kvplugins.sglang_hicache_backend","class_name":"KVPluginsHiCacheStorage","interface_v1":1}'

Importing this package imports SGLang and torch (only SGLang imports it). Files: storage.py (the class),
config.py (extra-config keys), pool.py (reading a host pool), legacy.py (flat-tensor API), metrics.py.
See docs/sglang.md.
"""

from kvplugins.sglang_hicache_backend.storage import KVPluginsHiCacheStorage

__all__ = ["KVPluginsHiCacheStorage"]
