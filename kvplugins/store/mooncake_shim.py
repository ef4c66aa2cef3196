"""The opt-in ``mooncake.store`` shim (kvplugins/shims.py): after ``kvplugins mooncake enable``, code written for
Mooncake 0.3.13 (SGLang's ``--hicache-storage-backend mooncake``, vLLM's MooncakeStoreConnector, scripts) gets
kvplugins.store.compat's MooncakeDistributedStore, so its unchanged ``master_server_address`` points it at a
kvplugins master. ``enable(site_dir, force)``, ``disable(site_dir)``, ``status(site_dir)``."""
from __future__ import annotations

from kvplugins.shims import Shim

SHIM = Shim("mooncake", "mooncake", "mooncake-transfer-engine",
            "`from mooncake.store import MooncakeDistributedStore` gives kvplugins' store client", (
                ("__init__.py", '"""mooncake, served by kvplugins (docs/store.md, Mooncake-compatible API)."""\n'),
                ("store.py", '''\
"""mooncake.store served by kvplugins.store.compat (docs/store.md, Mooncake-compatible API)."""
from kvplugins.store.compat import MooncakeDistributedStore, ObjectDataType, ReplicateConfig, SoftPinAction
from kvplugins.store.compat_extra import BufferHandle
from kvplugins.store.compat_parallel_types import ParallelAxis, ReadTarget, TensorParallelism
from kvplugins.store.compat_replicas import ReplicaStatus
from kvplugins.store.compat_tasks import QueryTaskResponse, TaskStatus, TaskType

__all__ = ["BufferHandle", "MooncakeDistributedStore", "ObjectDataType", "ParallelAxis", "QueryTaskResponse",
           "ReadTarget", "ReplicaStatus", "ReplicateConfig", "SoftPinAction", "TaskStatus", "TaskType",
           "TensorParallelism"]
''')))
enable, disable, status = SHIM.enable, SHIM.disable, SHIM.status
