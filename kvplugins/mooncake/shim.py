"""The opt-in ``mooncake.store`` shim (kvplugins/shims.py): after ``kvplugins mooncake enable``, code written for
Mooncake 0.3.13 (SGLang's ``--hicache-storage-backend mooncake``, vLLM's MooncakeStoreConnector, scripts) gets
kvplugins.mooncake's MooncakeDistributedStore, so its unchanged ``master_server_address`` points it at a
kvplugins master. ``enable(site_dir, force)``, ``disable(site_dir)``, ``status(site_dir)``."""

from __future__ import annotations

from kvplugins.shims import Shim

SHIM = Shim(
    "mooncake",
    "mooncake",
    "mooncake-transfer-engine",
    "`from mooncake.store import MooncakeDistributedStore` gives kvplugins' store client, "
    "`from mooncake.engine import TransferEngine` its transfer core",
    (
        ("__init__.py", '"""mooncake, served by kvplugins (docs/store.md, Mooncake-compatible API)."""\n'),
        (
            "store.py",
            '''\
"""mooncake.store served by kvplugins.mooncake (docs/store.md, Mooncake-compatible API)."""
from kvplugins.mooncake import *  # noqa: F401,F403 - the API, as kvplugins.mooncake.__all__ names it
from kvplugins.mooncake import __all__  # noqa: F401
''',
        ),
        (
            "engine.py",
            '''\
"""mooncake.engine served by kvplugins.mooncake.te (docs/transfer.md, Mooncake Transfer Engine API)."""
from kvplugins.mooncake.te import Read, TransferEngine, TransferNotify, TransferOpcode, Write  # noqa: F401
''',
        ),
    ),
)
enable, disable, status = SHIM.enable, SHIM.disable, SHIM.status
