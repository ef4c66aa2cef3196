"""Mooncake 0.3.13's unified parallel tensor IO, a mixin of api.MooncakeDistributedStore: the twelve
``*_tensor_with_parallelism*`` methods (put / upsert / get, single and batch, over tensors or caller buffers).
Types, validation, key names and manifests: parallel_types.py. Behaviour as the 0.3.13 wheel answered
against a real mooncake_master (tests/store/test_mooncake_parallel.py runs the same script on both):

Writes (``parallelism`` or ``writer_partition``, not both: -600):
  * None: a plain put_tensor.
  * one TP axis: the tensor is that rank's shard, stored under ``{key}_tp_{rank}``; global shape = the shard's
    with split_dim times size. A TP axis with others (DP/EP/PP): the tensor is the whole one, the rank's slice is
    stored (the dimension must split evenly). Both store the ``__parallelism_manifest`` too.
  * axes without TP: the whole tensor under the axes' key, no manifest.
  * a writer partition (rank, size, split_dim): the rank's slice of the whole tensor, and ``__writer_manifest``.
  * the ``_from`` forms read a whole tensor from a caller buffer in Mooncake's layout (exactly header + data
    bytes) and, with TP, store every TP rank's slice (Mooncake ignores the requested rank there), no manifest.
  A put of a stored key keeps it (0); upsert replaces it. Batch forms: ``parallelisms`` / ``writer_partitions``
  a list as long as ``keys`` (else -600 for every key), None items are plain puts, codes per key.
Reads (``target`` a ReadTarget; None = as stored):
  * as_stored: the object under ``key`` (with a parallelism: None).
  * shard: the stored shard with exactly those axes; else a writer shard with that TP axis; else, with a TP
    axis, the whole tensor rebuilt from the shards (below) and sliced for the requested TP rank and size.
  * full: with a TP axis, the rebuilt whole tensor; without a parallelism, the writer shards reassembled (or the
    object under ``key``).
  Rebuilding: the shards the manifest names (its count, the request's other axes), else those found from
  ``{key}_tp_0``'s own description (one TP axis) or the request's TP size (several axes); each must carry the
  same axes but for the TP rank, together covering the dimension. A miss is None.
  Unlike Mooncake 0.3.13, a one-TP-axis shard read never falls back to ``{key}_tp_{rank}`` when that object's own
  description contradicts the request (another split_dim or TP size): Mooncake returns those bytes, here it is a
  miss (never the wrong shard).
``_into`` reads write Mooncake's 304-byte header and the data into a registered buffer (the stored shard's
description, a rebuilt whole tensor's plain header, or a re-sliced shard's requested axes) and return a tensor
viewing it; None when the buffer is not inside registered memory or too small.
"""

from __future__ import annotations

from kvplugins.errors import StoreError
from kvplugins.mooncake.codes import INVALID_PARAMS, OK, guard, code_of, log, pybind
from kvplugins.mooncake.extra import tensor_and_meta, tensor_bytes
from kvplugins.mooncake.parallel_types import (
    Axis,
    axes_of,
    canonical,
    manifest,
    manifest_key,
    read_manifest,
    shard_key,
    target_of,
    tp_axis,
    with_tp,
    writer_key,
    writer_of,
)
from kvplugins.mooncake.tensor_buffers import HEADER_BYTES, dtype_code, from_buffer, into_buffer, parse
from kvplugins.mooncake.checks import DEFAULT, ReplicateConfig
from kvplugins.transfer.memory import view_of


def _codes(err, keys=(), *_):
    return [INVALID_PARAMS] * len(keys)


def _nones(err, keys=(), *_):
    return [None] * len(keys)


class ParallelMethods:
    """Mixed into MooncakeDistributedStore (``_cb``, ``_put_tensors``, ``_replaceable``, ``_put_cfg``,
    ``_buffers``)."""

    # ---- writes ------------------------------------------------------------------------------------------------
    @pybind
    @guard(on_error=lambda *_: INVALID_PARAMS)
    def put_tensor_with_parallelism(
        self,
        key: str,
        tensor: object,
        parallelism: object = None,
        config: ReplicateConfig = DEFAULT,
        writer_partition: object = None,
    ) -> int:
        """Store ``tensor`` (torch, CPU) as the shard ``parallelism`` names, or a ``writer_partition`` slice of
        it (module doc). 0 or -600."""
        return self._write([key], [tensor], [parallelism], [writer_partition], config, upsert=False)[0]

    @pybind
    @guard(on_error=lambda *_: INVALID_PARAMS)
    def upsert_tensor_with_parallelism(
        self,
        key: str,
        tensor: object,
        parallelism: object = None,
        config: ReplicateConfig = DEFAULT,
        writer_partition: object = None,
    ) -> int:
        return self._write([key], [tensor], [parallelism], [writer_partition], config, upsert=True)[0]

    @pybind
    @guard(on_error=_codes)
    def batch_put_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list,
        parallelisms: object = None,
        config: ReplicateConfig = DEFAULT,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._batch_write(keys, tensors_list, parallelisms, writer_partitions, config, upsert=False)

    @pybind
    @guard(on_error=_codes)
    def batch_upsert_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list,
        parallelisms: object = None,
        config: ReplicateConfig = DEFAULT,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._batch_write(keys, tensors_list, parallelisms, writer_partitions, config, upsert=True)

    @pybind
    @guard(on_error=lambda *_: INVALID_PARAMS)
    def put_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: object = None,
        config: ReplicateConfig = DEFAULT,
        writer_partition: object = None,
    ) -> int:
        """As put_tensor_with_parallelism, the whole tensor read from a buffer in Mooncake's layout (exactly
        header + data bytes); with TP every TP rank's slice is stored."""
        return self._batch_from([key], [buffer_ptr], [size], _one(parallelism), _one(writer_partition), config, False)[
            0
        ]

    @pybind
    @guard(on_error=lambda *_: INVALID_PARAMS)
    def upsert_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: object = None,
        config: ReplicateConfig = DEFAULT,
        writer_partition: object = None,
    ) -> int:
        return self._batch_from([key], [buffer_ptr], [size], _one(parallelism), _one(writer_partition), config, True)[0]

    @pybind
    @guard(on_error=_codes)
    def batch_put_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: object = None,
        config: ReplicateConfig = DEFAULT,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._batch_from(keys, buffer_ptrs, sizes, parallelisms, writer_partitions, config, False)

    @pybind
    @guard(on_error=_codes)
    def batch_upsert_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: object = None,
        config: ReplicateConfig = DEFAULT,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._batch_from(keys, buffer_ptrs, sizes, parallelisms, writer_partitions, config, True)

    # ---- reads -------------------------------------------------------------------------------------------------
    @pybind
    @guard(on_error=lambda *_: None)
    def get_tensor_with_parallelism(self, key: str, target: object = None) -> object:
        """The tensor ``target`` (a ReadTarget) asks for (module doc), or None."""
        return self._read(key, target, fallback=True)[0]

    @pybind
    @guard(on_error=_nones)
    def batch_get_tensor_with_parallelism(self, keys: list[str], targets: object = None) -> list:
        targets = _per_item(targets, len(keys), "targets")
        return [None if t is _BAD else self._read(k, t, fallback=True)[0] for k, t in zip(keys, targets)]

    @pybind
    @guard(on_error=lambda *_: None)
    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int, target: object = None) -> object:
        """get_tensor_with_parallelism written into a registered buffer (header + data); a tensor viewing it,
        or None."""
        return self.batch_get_tensor_with_parallelism_into([key], [buffer_ptr], [size], [target])[0]

    @pybind
    @guard(on_error=_nones)
    def batch_get_tensor_with_parallelism_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], targets: object = None
    ) -> list:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [None] * len(keys)
        targets = _per_item(targets, len(keys), "targets")
        out = []
        for key, ptr, size, target in zip(keys, buffer_ptrs, sizes, targets):
            tensor, meta = (
                (None, None)
                if target is _BAD or not self._registered(ptr, size)
                else self._read(key, target, fallback=False)
            )
            out.append(None if tensor is None else into_buffer(tensor, ptr, size, meta))
        return out

    # ---- write plans -------------------------------------------------------------------------------------------
    def _batch_write(self, keys, tensors, parallelisms, writers, config, upsert: bool) -> list[int]:
        n = len(keys)
        if parallelisms is not None and writers is not None or len(tensors) != n:
            return [INVALID_PARAMS] * n
        ps = _per_item(parallelisms, n, "parallelisms")
        ws = _per_item(writers, n, "writer_partitions")
        if any(x is _BAD for x in ps + ws):
            return [INVALID_PARAMS] * n
        return self._write(list(keys), list(tensors), ps, ws, config, upsert)

    def _write(self, keys, tensors, parallelisms, writers, config, upsert: bool, every_rank: bool = False) -> list:
        """Store each tensor as its parallelism / writer partition says; per key 0 or -600, the first failing
        code of its shards and manifest (one put batch for all of them)."""
        plans = []
        for key, tensor, p, w in zip(keys, tensors, parallelisms, writers):
            try:
                plans.append(_plan(key, tensor, p, w, every_rank))
            except ValueError as e:
                log.warning("parallel tensor write of %r refused: %s", key, e)
                plans.append(None)
        flat = [item for items in plans if items for item in items]
        codes = iter(self._store(flat, config, upsert) if flat else [])
        out = []
        for items in plans:
            got = [INVALID_PARAMS] if items is None else [next(codes) for _ in items]
            out.append(next((c for c in got if c != OK), OK))
        return out

    def _store(self, plan, config, upsert: bool) -> list[int]:
        """plan: [(key, tensor or manifest bytes, meta)]: shards and manifests in one put batch; per item its code."""
        keys = [k for k, _, _ in plan]
        if upsert:
            self._replaceable(keys)
        blobs = [v if isinstance(v, bytes) else tensor_bytes(v, m) for _, v, m in plan]
        return [code_of(e) for e in self._cb.batch_put(keys, blobs, self._put_cfg(config))]

    def _batch_from(self, keys, ptrs, sizes, parallelisms, writers, config, upsert: bool) -> list[int]:
        n = len(keys)
        if len(ptrs) != n or len(sizes) != n or parallelisms is not None and writers is not None:
            return [INVALID_PARAMS] * n
        tensors = [_exact_or_none(p, s) for p, s in zip(ptrs, sizes)]
        if parallelisms is None and writers is None:
            if any(t is None for t in tensors):
                return [INVALID_PARAMS] * n  # the plain path refuses the whole batch, as Mooncake
            return self._put_tensors(list(keys), tensors, config, upsert)
        ps = _per_item(parallelisms, n, "parallelisms")
        ws = _per_item(writers, n, "writer_partitions")
        return [
            INVALID_PARAMS
            if p is _BAD or w is _BAD or t is None
            else self._write([k], [t], [p], [w], config, upsert, every_rank=True)[0]
            for k, t, p, w in zip(keys, tensors, ps, ws)
        ]

    # ---- read plans --------------------------------------------------------------------------------------------
    def _get(self, key: str):
        """(tensor, meta) stored under ``key``; (None, None) for a miss."""
        return self._get_many([key])[0]

    def _get_many(self, keys: list[str]) -> list:
        """Per key (tensor, meta) or (None, None), in one batch read."""
        return [(None, None) if isinstance(v, StoreError) else tensor_and_meta(v) for v in self._cb.batch_get(keys)]

    def _read(self, key: str, target, fallback: bool):
        """(tensor, meta for an _into header) of a read, or (None, None)."""
        try:
            mode, axes = target_of(target)
        except ValueError as e:
            log.warning("parallel tensor read of %r refused: %s", key, e)
            return None, None
        if axes is None:
            if mode == "shard":
                return None, None
            return (self._writer_full(key) or self._get(key)) if mode == "full" else self._get(key)
        tp = tp_axis(axes)
        if mode == "as_stored" or mode == "full" and tp is None:
            return None, None
        if mode == "full":
            return self._rebuild(key, axes, tp), None
        return self._shard(key, axes, tp, fallback)

    def _shard(self, key: str, axes, tp: Axis | None, fallback: bool):
        tensor, meta = self._get(shard_key(key, axes))
        if tensor is not None and _axes_equal(meta, axes):
            return tensor, meta
        if len(axes) == 1 and tp is not None:
            tensor, meta = self._get(writer_key(key, tp))
            if tensor is not None and _axes_equal(meta, axes):
                return tensor, meta
        if tp is not None:
            whole = self._rebuild(key, axes, tp)
            if whole is not None and whole.dim() > tp.split_dim and whole.shape[tp.split_dim] % tp.size == 0:
                return _slice(whole, tp), {"g": list(whole.shape), "axes": [a.wire() for a in axes]}
        if fallback and len(axes) == 1 and tp is not None:
            tensor, meta = self._get(key if tp.size <= 1 else f"{key}_tp_{tp.rank}")
            if tensor is not None and (meta is None and tp.size <= 1 or _axes_equal(meta, axes)):
                return tensor, meta
        return None, None

    def _rebuild(self, key: str, axes, tp: Axis):
        """The whole tensor from its TP shards (module doc), or None."""
        found = read_manifest(self._raw(manifest_key(key)))
        if found is not None and found[1] == tp.split_dim:
            whole = self._concat(key, axes, tp, found[2], found[0])
            if whole is not None:
                return whole
        if len(axes) == 1:
            first, meta = self._get(key if tp.size <= 1 else f"{key}_tp_0")
            stored = tp_axis([Axis.from_wire(a) for a in (meta or {}).get("axes", [])])
            if first is None or stored is None or stored.split_dim != tp.split_dim:
                return None
            return self._concat(key, axes, tp, stored.size, tuple(meta["g"]))
        return self._concat(key, axes, tp, tp.size, None)

    def _concat(self, key: str, axes, tp: Axis, count: int, shape):
        wants = [with_tp(axes, r, count) for r in range(count)]
        return self._assemble([(shard_key(key, w), w) for w in wants], tp.split_dim, shape)

    def _writer_full(self, key: str):
        """(whole tensor, None) from a writer manifest's shards, or None when there is no writer manifest."""
        found = read_manifest(self._raw(manifest_key(key, writer=True)))
        if found is None:
            return None
        shape, sd, count = found
        axes = [Axis("tp", r, count, sd) for r in range(count)]
        return self._assemble([(writer_key(key, a), (a,)) for a in axes], sd, shape), None

    def _assemble(self, shards: list, dim: int, shape):
        """The whole tensor from [(key, the axes its shard must carry)] in rank order, concatenated along ``dim``
        (one batch read), or None when one is missing or does not fit (``shape``: the expected whole, or None)."""
        import torch

        parts = []
        for (tensor, meta), (_, axes) in zip(self._get_many([k for k, _ in shards]), shards):
            if tensor is None or not _axes_equal(meta, axes):
                return None
            parts.append(tensor)
        try:
            whole = torch.cat(parts, dim=dim)
        except (RuntimeError, IndexError):
            return None
        return whole if shape is None or tuple(whole.shape) == tuple(shape) else None

    def _raw(self, key: str):
        value = self._cb.batch_get([key])[0]
        return None if isinstance(value, StoreError) else value

    def _registered(self, ptr: int, size: int) -> bool:
        return any(p <= ptr and ptr + size <= p + r.length for p, r in self._buffers.items())


_BAD = object()


def _one(value):
    return None if value is None else [value]


def _per_item(values, n: int, name: str) -> list:
    """``values`` (None or a list of n items) as n items; _BAD for every item when it is neither (Mooncake: -600
    or None for each key)."""
    if values is None:
        return [None] * n
    if type(values) is not list or len(values) != n:
        log.warning("%s must be None or a list of %d items (got %.80r)", name, n, values)
        return [_BAD] * n
    return values


def _plan(key: str, tensor, parallelism, writer, every_rank: bool) -> list:
    """[(store key, tensor or manifest bytes, meta)] of one write. Raises ValueError (-600)."""
    import torch

    if parallelism is not None and writer is not None:
        raise ValueError("give parallelism or writer_partition, not both")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{type(tensor).__name__} is not a torch.Tensor")
    dtype_code(tensor.dtype)
    tensor = tensor.detach().to("cpu").contiguous()
    if parallelism is None and writer is None:
        return [(key, tensor, None)]
    if writer is not None:
        axis = writer_of(writer)
        _check_split(tensor, axis)
        return [
            (writer_key(key, axis), _slice(tensor, axis), _meta(tensor.shape, (axis,))),
            (manifest_key(key, writer=True), _manifest(tensor, axis), None),
        ]
    axes = axes_of(parallelism)
    tp = tp_axis(axes)
    if tp is None:
        return [(shard_key(key, axes), tensor, _meta(tensor.shape, axes))]
    if every_rank:  # the _from forms: the buffer is the whole tensor, every TP rank stored
        _check_split(tensor, tp)
        return [
            (
                shard_key(key, with_tp(axes, r, tp.size)),
                _slice(tensor, Axis("tp", r, tp.size, tp.split_dim)),
                _meta(tensor.shape, with_tp(axes, r, tp.size)),
            )
            for r in range(tp.size)
        ]
    if len(axes) == 1:  # the tensor is this rank's shard
        if not 0 <= tp.split_dim < tensor.dim():
            raise ValueError(f"split_dim={tp.split_dim} is not a dimension of a {tensor.dim()}-d tensor")
        shape = list(tensor.shape)
        shape[tp.split_dim] *= tp.size
        return [
            (shard_key(key, axes), tensor, _meta(shape, axes)),
            (manifest_key(key), _manifest(tensor, tp, shape), None),
        ]
    _check_split(tensor, tp)
    return [
        (shard_key(key, axes), _slice(tensor, tp), _meta(tensor.shape, axes)),
        (manifest_key(key), _manifest(tensor, tp), None),
    ]


def _check_split(tensor, axis: Axis) -> None:
    if not 0 <= axis.split_dim < tensor.dim() or tensor.shape[axis.split_dim] % axis.size:
        raise ValueError(
            f"split_dim={axis.split_dim} of a tensor of shape {tuple(tensor.shape)} does not split "
            f"evenly over {axis.size} (Mooncake supports uniform sharding only)"
        )


def _slice(tensor, axis: Axis):
    n = tensor.shape[axis.split_dim] // axis.size
    return tensor.narrow(axis.split_dim, axis.rank * n, n).contiguous()


def _meta(shape, axes) -> dict:
    return {"g": list(shape), "axes": [a.wire() for a in axes]}


def _manifest(tensor, axis: Axis, shape=None) -> bytes:
    return manifest(dtype_code(tensor.dtype), list(shape or tensor.shape), axis.split_dim, axis.size)


def _axes_equal(meta, axes) -> bool:
    if not meta:
        return False
    return canonical(Axis.from_wire(a) for a in meta.get("axes", [])) == canonical(axes)


def _exact_buffer(ptr: int, size: int):
    """The whole tensor in a caller buffer that holds exactly header + data bytes. Raises ValueError."""
    if ptr <= 0 or size < HEADER_BYTES:
        raise ValueError(f"buffer {ptr:#x} of {size} bytes cannot hold a Mooncake tensor header")
    _, _, offset, nbytes = parse(view_of(ptr, size))
    if offset + nbytes != size:
        raise ValueError(f"buffer of {size} bytes holds a tensor of {offset + nbytes} bytes: give its exact size")
    return from_buffer(ptr, size)


def _exact_or_none(ptr: int, size: int):
    try:
        return _exact_buffer(ptr, size)
    except ValueError as e:
        log.warning("parallel tensor write refused: %s", e)
        return None
