"""The Mooncake-compatible API, an adapter beside the vLLM and SGLang ones: Mooncake 0.3.13's
``mooncake.store`` Python API (``MooncakeDistributedStore`` and its types) over kvplugins' StoreClient, and the
opt-in shim that serves it as ``mooncake.store`` (``kvplugins mooncake enable``). Rooms: ``api``
(MooncakeDistributedStore), ``checks`` (pybind11's argument conversions, ReplicateConfig), ``codes`` (Mooncake's
ErrorCodes: the one place exceptions become integers), ``extra`` (upsert, BufferHandle, tensors),
``tensor_buffers``, ``parallel`` + ``parallel_types`` (unified parallel tensor IO), ``sessions``, ``replicas``,
``tasks``, ``buffer_pool`` (BufferPool: leases of registered memory), ``shim``. Contract and differences: docs/store.md, "Mooncake-compatible API"."""

from kvplugins.mooncake.api import MooncakeDistributedStore
from kvplugins.mooncake.buffer_pool import BufferLease, BufferPool, RegisteredBufferPool
from kvplugins.mooncake.checks import ObjectDataType, ReplicateConfig, SoftPinAction
from kvplugins.mooncake.extra import BufferHandle
from kvplugins.mooncake.parallel_types import ParallelAxis, ReadTarget, TensorParallelism
from kvplugins.mooncake.replicas import ReplicaStatus
from kvplugins.mooncake.tasks import QueryTaskResponse, TaskStatus, TaskType

__all__ = [
    "BufferHandle",
    "BufferLease",
    "BufferPool",
    "MooncakeDistributedStore",
    "ObjectDataType",
    "ParallelAxis",
    "QueryTaskResponse",
    "ReadTarget",
    "RegisteredBufferPool",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
    "TaskStatus",
    "TaskType",
    "TensorParallelism",
]
