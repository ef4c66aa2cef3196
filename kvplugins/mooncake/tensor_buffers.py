"""Mooncake 0.3.13's tensor forms over a caller's buffer (``put_tensor_from``, ``get_tensor_into`` and their batch,
upsert and TP variants), a mixin of api.MooncakeDistributedStore, and the buffer layout they use,
``[TensorMetadata][tensor data]``. The layout was read off the bytes a real mooncake_master 0.3.13 client stores for
``put_tensor`` (tests/store/test_mooncake_api.py checks ours against them), not from its headers:

    offset  size  field
    0       4     magic b"NOOM"
    4       2     version 1 (little-endian, as every field)
    6       2     header size 304
    8       4     dtype (MOONCAKE_DTYPES order: float32 = 0 ... float8_e5m2 = 14)
    12      4     ndim (<= 8)
    16      8     layout (0 a whole tensor; 1 a shard of a parallel tensor)
    24      8     data offset (304)
    32      8     data bytes
    40      64    global shape: 8 x int64, -1 past ndim
    104     64    local shape: the same (the shard's own shape for a shard)
    168     136   shard description (zeros for a whole tensor): axis count, 0, then 32 bytes per axis (_axis_block)

The store itself keeps tensors as safetensors bytes; this layout exists only in the caller's buffers.
"""

from __future__ import annotations

import struct

from kvplugins.mooncake.codes import INVALID_PARAMS, guard, per_key, pybind
from kvplugins.mooncake.checks import DEFAULT, I32, same_length
from kvplugins.transfer.memory import view_of

HEADER_BYTES = 304
MAGIC = b"NOOM"
MAX_DIMS = 8
MOONCAKE_DTYPES = (
    "float32",
    "float64",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "bool",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
)
_FIXED = struct.Struct("<4sHHIiQQQ")
_AXIS = struct.Struct("<iiiiiiq")
AXIS_KINDS = ("dp", "tp", "ep", "pp")


def header(tensor, meta: dict | None = None) -> bytes:
    """The 304-byte header of a (contiguous) tensor: a whole one (layout 0), or with ``meta`` (a shard's
    description, extra.tensor_bytes) a shard (layout 1: the global shape, then the axis block). Raises
    ValueError for a dtype Mooncake lacks or too many dimensions."""
    code = dtype_code(tensor.dtype)
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"a tensor of {tensor.dim()} dimensions has no Mooncake tensor layout (at most {MAX_DIMS})")
    local = _shape(tensor.shape)
    fixed = _FIXED.pack(
        MAGIC,
        1,
        HEADER_BYTES,
        code,
        tensor.dim(),
        1 if meta else 0,
        HEADER_BYTES,
        tensor.numel() * tensor.element_size(),
    )
    head = fixed + (_shape(meta["g"]) + local + _axis_block(meta["axes"], tensor.shape) if meta else local + local)
    return head + bytes(HEADER_BYTES - len(head))


def dtype_code(dtype) -> int:
    """Mooncake's code of a torch dtype. Raises ValueError for one it lacks."""
    name = str(dtype).removeprefix("torch.")
    if name not in MOONCAKE_DTYPES:
        raise ValueError(f"{name} has no Mooncake tensor layout (dtypes: {', '.join(MOONCAKE_DTYPES)})")
    return MOONCAKE_DTYPES.index(name)


def _shape(dims) -> bytes:
    return struct.pack(f"<{MAX_DIMS}q", *(list(dims) + [-1] * (MAX_DIMS - len(dims))))


def _axis_block(axes, local) -> bytes:
    """At 168: axis count, 0, then per axis (caller order) kind code (DP 0, TP 1, EP 2, PP 3), its index, rank,
    size, split_dim (-1: none), expert/stage id, the local extent of split_dim (0: none)."""
    out = struct.pack("<II", len(axes), 0)
    for i, (kind, rank, size, sd, extra) in enumerate(axes):
        out += _AXIS.pack(AXIS_KINDS.index(kind), i, rank, size, sd, extra, local[sd] if sd >= 0 else 0)
    return out


def parse(buf: memoryview):
    """(torch dtype, local shape, data offset, data bytes) from a buffer in the layout. Raises ValueError for a
    buffer that is not one (bad magic, dtype, dimensions, or sizes that do not fit ``len(buf)``)."""
    import torch

    if len(buf) < HEADER_BYTES:
        raise ValueError(f"a {len(buf)}-byte buffer cannot hold Mooncake's {HEADER_BYTES}-byte tensor header")
    magic, _, _, dtype, ndim, _, offset, nbytes = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC or not 0 <= dtype < len(MOONCAKE_DTYPES) or not 0 <= ndim <= MAX_DIMS:
        raise ValueError("the buffer does not start with a Mooncake tensor header (magic, dtype or ndim)")
    shape = struct.unpack_from(f"<{MAX_DIMS}q", buf, 104)[:ndim]
    dt = getattr(torch, MOONCAKE_DTYPES[dtype])
    n = 1
    for d in shape:
        n *= d
    if offset + nbytes > len(buf) or n * dt.itemsize != nbytes or any(d < 0 for d in shape):
        raise ValueError(
            f"tensor header of shape {shape} and {nbytes} data bytes does not fit a {len(buf)}-byte buffer"
        )
    return dt, shape, offset, nbytes


def from_buffer(ptr: int, size: int):
    """The tensor in the buffer at ``ptr`` (``size`` bytes, Mooncake's layout), viewing that memory. Raises
    ValueError when the buffer does not hold one."""
    import torch

    if ptr <= 0:
        raise ValueError(f"buffer address {ptr:#x} is not valid memory")
    buf = view_of(ptr, size)
    dtype, shape, offset, nbytes = parse(buf)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf[offset : offset + nbytes], dtype=dtype).reshape(shape)


def into_buffer(tensor, ptr: int, size: int, meta: dict | None = None):
    """Write ``tensor`` into the buffer at ``ptr`` in Mooncake's layout (``meta``: as header); returns a tensor
    viewing its data there, or None when it does not fit in ``size`` bytes (or has no Mooncake dtype)."""
    import torch

    try:
        head = header(tensor, meta)
    except ValueError:
        return None
    data = tensor.contiguous().view(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
    if ptr <= 0 or size < HEADER_BYTES + data.numel():
        return None
    buf = view_of(ptr, HEADER_BYTES + data.numel())
    buf[:HEADER_BYTES] = head
    if not data.numel():
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    buf[HEADER_BYTES:] = data.numpy().tobytes()
    return torch.frombuffer(buf[HEADER_BYTES:], dtype=tensor.dtype).reshape(tensor.shape)


class TensorBufferMethods:
    """Mixed into MooncakeDistributedStore (``_put_tensors``, ``batch_get_tensor``, the TP methods, ``_get_many``)."""

    @pybind
    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store the tensor held in the buffer (Mooncake's layout: the module doc). 0, or INVALID_PARAMS when the
        buffer does not hold one."""
        return self.batch_put_tensor_from([key], [buffer_ptr], [size])[0]

    @pybind
    @guard(on_error=per_key)
    def batch_put_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._tensors_from(keys, buffer_ptrs, sizes, upsert=False)

    @pybind
    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_upsert_tensor_from([key], [buffer_ptr], [size])[0]

    @pybind
    @guard(on_error=per_key)
    def batch_upsert_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._tensors_from(keys, buffer_ptrs, sizes, upsert=True)

    @pybind
    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> object:
        """Write the tensor stored under ``key`` into the buffer (Mooncake's layout); returns a tensor viewing its
        data there, or None for a miss or a buffer too small."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    @pybind
    @guard(on_error=lambda err, keys=(), *_: [None] * len(keys))
    def batch_get_tensor_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list:
        same_length(keys, buffer_ptrs, sizes)
        return [
            None if t is None else into_buffer(t, p, n)
            for t, p, n in zip(self.batch_get_tensor(list(keys)), buffer_ptrs, sizes)
        ]

    @pybind
    @guard()
    def put_tensor_with_tp_from(
        self, key: str, buffer_ptr: int, size: int, tp_rank: I32 = 0, tp_size: I32 = 1, split_dim: I32 = 0
    ) -> int:
        """put_tensor_with_tp of the whole tensor held in the buffer."""
        return self.put_tensor_with_tp(key, from_buffer(buffer_ptr, size), tp_rank, tp_size, split_dim)

    @pybind
    @guard(on_error=per_key)
    def batch_put_tensor_with_tp_from(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: I32 = 0,
        tp_size: I32 = 1,
        split_dim: I32 = 0,
    ) -> list[int]:
        same_length(base_keys, buffer_ptrs, sizes)
        return [
            self.put_tensor_with_tp_from(k, p, n, tp_rank, tp_size, split_dim)
            for k, p, n in zip(base_keys, buffer_ptrs, sizes)
        ]

    @pybind
    def get_tensor_with_tp_into(
        self, key: str, buffer_ptr: int, size: int, tp_rank: I32 = 0, tp_size: I32 = 1, split_dim: I32 = 0
    ) -> object:
        """Shard ``tp_rank`` (get_tensor_with_tp) written into the buffer, its header describing the shard; a
        tensor viewing it, or None."""
        return self.batch_get_tensor_with_tp_into([key], [buffer_ptr], [size], tp_rank, tp_size)[0]

    @pybind
    @guard(on_error=lambda err, keys=(), *_: [None] * len(keys))
    def batch_get_tensor_with_tp_into(
        self, base_keys: list[str], buffer_ptrs: list[int], sizes: list[int], tp_rank: I32 = 0, tp_size: I32 = 1
    ) -> list:
        same_length(base_keys, buffer_ptrs, sizes)
        found = self._get_many([k if tp_size <= 1 else f"{k}_tp_{tp_rank}" for k in base_keys])  # parallel.py
        return [None if t is None else into_buffer(t, p, n, meta) for (t, meta), p, n in zip(found, buffer_ptrs, sizes)]

    def _tensors_from(self, keys, ptrs, sizes, upsert: bool) -> list[int]:
        """One put batch; a buffer that holds no tensor fails the whole batch with INVALID_PARAMS, as Mooncake."""
        same_length(keys, ptrs, sizes)
        try:
            tensors = [from_buffer(p, n) for p, n in zip(ptrs, sizes)]
        except ValueError:
            return [INVALID_PARAMS] * len(keys)
        return self._put_tensors(list(keys), tensors, DEFAULT, upsert)
