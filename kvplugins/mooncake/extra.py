"""The rest of Mooncake 0.3.13's ``MooncakeDistributedStore`` that applies to a CPU store, as a mixin of
api.MooncakeDistributedStore: health and host name, batch remove, upsert (insert or replace) in its bytes,
parts and zero-copy forms, BufferHandle reads, and the tensor API.

Tensors (torch, CPU) are stored as safetensors bytes (one tensor named "tensor": dtype, shape and bytes kept for
every dtype safetensors has, bf16 included; a non-contiguous tensor is stored contiguous); never pickle.
Mooncake stores its own TensorMetadata header instead, so a tensor written by one store is not readable by the
other, but nothing shares a store between them. Codes and argument checks as api.py (codes.py).
Signatures follow the wheel's pybind docstrings (tests/store/test_mooncake_api.py compares them).
"""

from __future__ import annotations

import json

import numpy as np

from kvplugins.errors import KeyNotFound, MasterUnreachable, StoreError
from kvplugins.mooncake.codes import OK, guard, per_key, code_of, log, pybind
from kvplugins.mooncake.checks import DEFAULT, I32, Buffer, ReplicateConfig
from kvplugins.store.wire import replies

TENSOR_NAME = "tensor"
SHARD_META = "mooncake_shard"  # safetensors metadata entry of a parallel tensor's shard (tensor_bytes)
_MISSING = object()


class BufferHandle(np.ndarray):
    """Mooncake's BufferHandle: an object's bytes in memory this client owns. ``ptr()``: address, ``size()``:
    bytes; also a buffer (``bytes(handle)``, ``memoryview(handle)``, ``numpy.asarray(handle)``), a 1-D uint8
    array underneath: Python 3.11 has no ``__buffer__`` hook, so the buffer protocol comes from numpy's C type."""

    def __new__(cls, data: bytes) -> "BufferHandle":
        return np.frombuffer(bytearray(data), dtype=np.uint8).view(cls)

    def ptr(self) -> int:
        return int(self.ctypes.data)

    def size(self) -> int:  # type: ignore[override]  # Mooncake's method, not numpy's attribute
        return int(self.nbytes)


class ExtraMethods:
    """Mixed into MooncakeDistributedStore (which provides ``_c``, ``_put_cfg``, ``_call``, ``put_batch``,
    ``batch_put_from``, ``get_batch``)."""

    # ---- health --------------------------------------------------------------------------------------
    @pybind
    def get_hostname(self) -> str:
        """This client's segment name, as Mooncake 0.3.13 answers (its segment is named by its host:port): what
        ``ReplicateConfig.preferred_segment`` takes to keep an object on the caller's own segment. Without a
        segment (``global_segment_size`` 0) the ``local_hostname`` given to setup; '' before setup."""
        name = self._client.segment_name if self._client is not None else None
        return name or self._hostname

    @pybind
    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 the master does not answer (Mooncake's codes)."""
        if self._client is None:
            return 1
        try:
            self._client.master_call("info", [])
        except MasterUnreachable:
            return 2
        return 0

    # ---- remove ----------------------------------------------------------------------------------------
    @pybind
    @guard(on_error=per_key)
    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        """Per key 0, OBJECT_NOT_FOUND or OBJECT_HAS_LEASE (a read lease runs and not ``force``); one RPC."""
        from kvplugins.mooncake.codes import OBJECT_HAS_LEASE, OBJECT_NOT_FOUND

        results = replies.outcomes(self._call("remove_checked", list(keys), {"force": bool(force)}), "remove_checked")
        return [{"removed": OK, "leased": OBJECT_HAS_LEASE}.get(r, OBJECT_NOT_FOUND) for r in results]

    # ---- upsert: insert or replace ----------------------------------------------------------------------
    @pybind
    @guard()
    def upsert(self, key: str, value: Buffer, config: ReplicateConfig = DEFAULT) -> int:
        """Store ``value`` under ``key``, replacing what is there (put only inserts). 0 or a negative code."""
        return self.upsert_batch([key], [value], config)

    @pybind
    @guard()
    def upsert_batch(self, keys: list[str], values: list[Buffer], config: ReplicateConfig = DEFAULT) -> int:
        """upsert of every key: one remove RPC for the batch, then put_batch. 0 or the first negative code. A
        reader that got the old object keeps valid bytes until its lease ends; between the two steps a get
        misses."""
        self._replaceable(keys)
        return self.put_batch(keys, values, config)

    @pybind
    @guard()
    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig = DEFAULT) -> int:
        """upsert of ``size`` bytes at ``buffer_ptr``. 0 or a negative code."""
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    @pybind
    @guard(on_error=per_key)
    def batch_upsert_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig = DEFAULT
    ) -> list[int]:
        """Per key 0 or a negative code: one remove RPC, then batch_put_from."""
        self._replaceable(keys)
        return self.batch_put_from(keys, buffer_ptrs, sizes, config)

    @pybind
    @guard()
    def put_parts(self, key: str, *args: Buffer, config: ReplicateConfig = DEFAULT) -> int:
        """Store the concatenation of the buffers ``args`` under ``key``. 0 or a negative code."""
        return self.put_batch([key], [b"".join(memoryview(a).cast("B") for a in args)], config)

    @pybind
    @guard()
    def upsert_parts(self, key: str, *args: Buffer, config: ReplicateConfig = DEFAULT) -> int:
        """put_parts, replacing what is stored under ``key``."""
        return self.upsert(key, b"".join(memoryview(a).cast("B") for a in args), config)

    def _replaceable(self, keys: list[str]) -> None:
        self._c.batch_remove(list(keys))  # a missing key is fine: upsert then inserts

    # ---- several buffers per object (scatter/gather, zero-copy) --------------------------------------------
    @pybind
    @guard(on_error=per_key)
    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig = DEFAULT,
    ) -> list[int]:
        """Store, per key, the concatenation of its buffers (registered memory: one transfer batch for all).
        Per key 0 or a negative code (INVALID_PARAMS for memory that was never registered)."""
        spans = _spans(keys, all_buffer_ptrs, all_sizes)
        return [code_of(e) for e in self._c.batch_put_from(list(keys), spans, self._put_cfg(config))]

    @pybind
    @guard(on_error=per_key)
    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Scatter each object over its buffers in order; their sizes must add up to the object's size (any split).
        Per key the bytes read, or a negative code: INVALID_PARAMS when they add up to less, TRANSFER_FAIL when
        to more (both as Mooncake 0.3.13 answers)."""
        from kvplugins.mooncake.codes import INVALID_PARAMS, TRANSFER_FAIL

        spans = _spans(keys, all_buffer_ptrs, all_sizes)
        out, todo = list(self._sizes(list(keys))), []
        for i, (n, key_spans) in enumerate(zip(out, spans)):
            held = sum(size for _, size in key_spans)
            if n >= 0:  # Mooncake: the sizes must add up to the object's (more: TRANSFER_FAIL)
                out[i] = INVALID_PARAMS if held < n else TRANSFER_FAIL if held > n else n
                todo += [i] if held == n else []
        errs = self._c.batch_get_into([keys[i] for i in todo], [spans[i] for i in todo])
        for i, err in zip(todo, errs):
            if err is not None:
                out[i] = code_of(err)
        return out

    # ---- BufferHandle reads ----------------------------------------------------------------------------
    @pybind
    @guard(on_error=lambda *_: None)
    def get_buffer(self, key: str, /) -> BufferHandle:
        """A BufferHandle of the bytes of ``key``, or None for a miss (or an error)."""
        return self.batch_get_buffer([key])[0]

    @pybind
    @guard(on_error=lambda err, keys=(), *_: [None] * len(keys))
    def batch_get_buffer(self, keys: list[str], /) -> list[BufferHandle]:
        """Per key a BufferHandle, or None for a miss."""
        return [None if isinstance(v, StoreError) else BufferHandle(v) for v in self._cb.batch_get(list(keys))]

    # ---- tensors ---------------------------------------------------------------------------------------
    @pybind
    def put_tensor(self, key: str, tensor: object) -> int:
        """Store a torch tensor (CPU; any dtype safetensors has). 0 or a negative code."""
        return self.batch_put_tensor([key], [tensor])[0]

    @pybind
    @guard(on_error=per_key)
    def batch_put_tensor(self, keys: list[str], tensors_list: list) -> list[int]:
        """Per key 0 or a negative code (one put batch)."""
        return self._put_tensors(keys, tensors_list, DEFAULT, upsert=False)

    @pybind
    def pub_tensor(self, key: str, tensor: object, config: ReplicateConfig = DEFAULT) -> int:
        """put_tensor with a ReplicateConfig."""
        return self.batch_pub_tensor([key], [tensor], config)[0]

    @pybind
    @guard(on_error=per_key)
    def batch_pub_tensor(self, keys: list[str], tensors_list: list, config: ReplicateConfig = DEFAULT) -> list[int]:
        return self._put_tensors(keys, tensors_list, config, upsert=False)

    @pybind
    def upsert_tensor(self, key: str, tensor: object) -> int:
        """put_tensor, replacing what is stored under ``key``."""
        return self.batch_upsert_tensor([key], [tensor])[0]

    @pybind
    @guard(on_error=per_key)
    def batch_upsert_tensor(self, keys: list[str], tensors_list: list) -> list[int]:
        return self._put_tensors(keys, tensors_list, DEFAULT, upsert=True)

    @pybind
    def upsert_pub_tensor(self, key: str, tensor: object, config: ReplicateConfig = DEFAULT) -> int:
        return self.batch_upsert_pub_tensor([key], [tensor], config)[0]

    @pybind
    @guard(on_error=per_key)
    def batch_upsert_pub_tensor(
        self, keys: list[str], tensors_list: list, config: ReplicateConfig = DEFAULT
    ) -> list[int]:
        return self._put_tensors(keys, tensors_list, config, upsert=True)

    @pybind
    def get_tensor(self, key: str) -> object:
        """The tensor stored under ``key`` (CPU), or None for a miss."""
        return self.batch_get_tensor([key])[0]

    @pybind
    @guard(on_error=lambda err, keys=(), *_: [None] * len(keys))
    def batch_get_tensor(self, keys: list[str]) -> list:
        """Per key the tensor, or None for a miss or bytes that are not a stored tensor."""
        return [None if isinstance(v, StoreError) else _tensor_or_none(v) for v in self._cb.batch_get(list(keys))]

    @pybind
    @guard()
    def save_tensor_to_safetensor(self, key: str, file_name: object = None) -> int:
        """Write the tensor stored under ``key`` to the safetensors file ``file_name`` (default: the key), as
        tensor ``key``. 0, or OBJECT_NOT_FOUND."""
        tensor = self.get_tensor(key)
        if tensor is None:
            raise KeyNotFound(key)
        from safetensors.torch import save_file

        save_file({key: tensor}, str(file_name if file_name is not None else key))
        return OK

    @pybind
    def load_tensor_from_safetensor(self, key: object = None, file_name: str = _MISSING) -> object:
        """Read a tensor from the safetensors file ``file_name`` (the one named ``key``, or its only one) and
        store it under ``key`` (default: its name in the file). Returns the tensor, or None if it could not be
        read or stored."""
        if file_name is _MISSING:
            raise TypeError("load_tensor_from_safetensor(): incompatible function arguments: file_name is required")
        from safetensors.torch import load_file

        try:
            tensors = load_file(file_name)
        except (OSError, ValueError) as e:
            _log_failure("load_tensor_from_safetensor", e)
            return None
        name = key if key is not None and key in tensors else next(iter(tensors), None) if len(tensors) == 1 else None
        if name is None:
            _log_failure("load_tensor_from_safetensor", ValueError(f"{file_name}: no tensor named {key!r}"))
            return None
        tensor = tensors[name]
        return tensor if self.put_tensor(str(key if key is not None else name), tensor) == OK else None

    # ---- tensor parallelism: shard i of a tensor lives under "{key}_tp_{i}" (Mooncake's key names) ---------
    @pybind
    def put_tensor_with_tp(
        self, key: str, tensor: object, tp_rank: I32 = 0, tp_size: I32 = 1, split_dim: I32 = 0
    ) -> int:
        """Store ``tensor`` split evenly along ``split_dim`` into ``tp_size`` shards, shard i under "{key}_tp_{i}"
        (tp_size <= 1: the whole tensor under ``key``). ``tp_rank`` is accepted as in Mooncake (every shard is
        written). 0, or INVALID_PARAMS when the dimension does not split evenly (as Mooncake)."""
        return self.batch_pub_tensor_with_tp([key], [tensor], DEFAULT, tp_rank, tp_size, split_dim)[0]

    @pybind
    def pub_tensor_with_tp(
        self,
        key: str,
        tensor: object,
        config: ReplicateConfig = DEFAULT,
        tp_rank: I32 = 0,
        tp_size: I32 = 1,
        split_dim: I32 = 0,
    ) -> int:
        return self.batch_pub_tensor_with_tp([key], [tensor], config, tp_rank, tp_size, split_dim)[0]

    @pybind
    def batch_put_tensor_with_tp(
        self, base_keys: list[str], tensors_list: list, tp_rank: I32 = 0, tp_size: I32 = 1, split_dim: I32 = 0
    ) -> list[int]:
        return self.batch_pub_tensor_with_tp(base_keys, tensors_list, DEFAULT, tp_rank, tp_size, split_dim)

    @pybind
    @guard(on_error=per_key)
    def batch_pub_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list,
        config: ReplicateConfig = DEFAULT,
        tp_rank: I32 = 0,
        tp_size: I32 = 1,
        split_dim: I32 = 0,
    ) -> list[int]:
        """Per base key 0 or the first negative code of its shards (one put batch for every shard)."""
        if tp_size <= 1:
            return self._put_tensors(base_keys, tensors_list, config, upsert=False)
        keys, shards, metas = [], [], []
        for key, tensor in zip(base_keys, tensors_list):
            for i, shard in enumerate(_tp_shards(tensor, tp_size, split_dim)):
                keys.append(_tp_key(key, i))
                shards.append(shard)
                metas.append({"g": list(tensor.shape), "axes": [["tp", i, tp_size, split_dim % tensor.dim(), 0]]})
        codes = self._put_tensors(keys, shards, config, upsert=False, metas=metas)
        return [next((c for c in codes[j * tp_size : (j + 1) * tp_size] if c != OK), OK) for j in range(len(base_keys))]

    @pybind
    def get_tensor_with_tp(self, key: str, tp_rank: I32 = 0, tp_size: I32 = 1, split_dim: I32 = 0) -> object:
        """Shard ``tp_rank`` of a tensor put with put_tensor_with_tp (tp_size <= 1: the tensor under ``key``), or
        None for a miss."""
        return self.get_tensor(key if tp_size <= 1 else _tp_key(key, tp_rank))

    @pybind
    def batch_get_tensor_with_tp(self, base_keys: list[str], tp_rank: I32 = 0, tp_size: I32 = 1) -> list:
        return self.batch_get_tensor(list(base_keys) if tp_size <= 1 else [_tp_key(k, tp_rank) for k in base_keys])

    def _put_tensors(self, keys, tensors, config, upsert: bool, metas=None) -> list[int]:
        """One put batch of tensors; ``metas``: per tensor its shard description or None (tensor_bytes)."""
        blobs = [tensor_bytes(t, m) for t, m in zip(tensors, metas or [None] * len(tensors))]
        if len(blobs) != len(keys) or len(tensors) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(blobs)} tensors")
        if upsert:
            self._replaceable(keys)
        errs = self._cb.batch_put(list(keys), blobs, self._put_cfg(config))
        return [code_of(e) for e in errs]


def _tp_key(key: str, rank: int) -> str:
    return f"{key}_tp_{rank}"


def _tp_shards(tensor, tp_size: int, split_dim: int) -> list:
    """``tensor`` cut along ``split_dim`` into ``tp_size`` equal shards. Raises ValueError for a non-tensor, a bad
    dimension or one that does not split evenly (Mooncake 0.3.13 answers INVALID_PARAMS for those)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{type(tensor).__name__} is not a torch.Tensor")
    if not -tensor.dim() <= split_dim < tensor.dim():
        raise ValueError(f"split_dim={split_dim} is not a dimension of a {tensor.dim()}-d tensor")
    d = tensor.shape[split_dim]
    if d % tp_size:
        raise ValueError(
            f"dimension {split_dim} of size {d} does not split evenly over tp_size={tp_size} (Mooncake refuses it too)"
        )
    return list(tensor.split(d // tp_size, dim=split_dim))


def _spans(keys, ptrs, sizes) -> list[list[tuple[int, int]]]:
    """Per key its (address, bytes) spans. Raises ValueError when the lists do not line up."""
    if not len(keys) == len(ptrs) == len(sizes) or any(len(p) != len(n) for p, n in zip(ptrs, sizes)):
        raise ValueError(
            "keys, all_buffer_ptrs and all_sizes must line up (one list of buffers per key, one size per buffer)"
        )
    return [list(zip(p, n)) for p, n in zip(ptrs, sizes)]


def tensor_bytes(tensor, meta: dict | None = None) -> bytes:
    """A torch tensor as safetensors bytes; ``meta``: the shard description of a parallel tensor's shard
    ({"g": global shape, "axes": [[kind, rank, size, split_dim or -1, expert/stage id or 0], ...]}, caller order),
    kept in the safetensors metadata. Raises ValueError for anything but a tensor (INVALID_PARAMS)."""
    import torch
    from safetensors.torch import save

    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{type(tensor).__name__} is not a torch.Tensor")
    return save(
        {TENSOR_NAME: tensor.detach().to("cpu").contiguous()}, metadata={SHARD_META: json.dumps(meta)} if meta else None
    )


def _tensor_or_none(data: bytes):
    return tensor_and_meta(data)[0]


def tensor_and_meta(data) -> tuple:
    """(tensor, shard description or None) of stored tensor bytes; (None, None) for bytes that are not one."""
    from safetensors.torch import load

    try:
        data = bytes(data)
        tensor = load(data).get(TENSOR_NAME)
        n = int.from_bytes(data[:8], "little")  # safetensors: u64 header length, then the JSON header
        meta = json.loads(data[8 : 8 + n]).get("__metadata__", {}).get(SHARD_META)
        return tensor, None if meta is None else json.loads(meta)
    except Exception as e:  # noqa: BLE001 - bytes that are not a stored tensor: a miss, as Mooncake's None
        _log_failure("get_tensor", e)
        return None, None


def _log_failure(what: str, err: BaseException) -> None:
    log.warning("%s failed: %s", what, err)
