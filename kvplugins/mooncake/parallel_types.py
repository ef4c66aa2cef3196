"""Mooncake 0.3.13's parallel tensor request types (``ParallelAxis``, ``TensorParallelism``, ``ReadTarget``), their
validation, and the names and manifest objects of a parallel tensor's shards in the store. Behaviour observed on
the 0.3.13 wheel against a real mooncake_master (its design: docs/source/design/store/unified-parallel-tensor-io.md;
store_py_parallel_write.h / _read.h, upstream HEAD 3b5a594; read, not copied).

An axis is (kind, rank, size, split_dim, extra): kind "dp" | "tp" | "ep" | "pp" (case-insensitive on input),
0 <= rank < size, split_dim only on TP (and required there), extra = expert_id (EP, required), stage_id (PP,
required), else None. At most one axis per kind, 1 to 4 axes.

Keys: one TP axis alone: ``{key}_tp_{rank}``; otherwise ``{key}`` + ``__{kind}_{rank}of{size}`` (+ ``_sd{d}``,
``_eid{e}``, ``_sid{s}``) per axis in the order DP, TP, EP, PP; a writer partition: ``{key}__writer_{r}of{n}_sd{d}``.
A TP-containing write also stores ``{key}__parallelism_manifest`` (a writer: ``{key}__writer_manifest``): 96 bytes,
magic "WMAN" (LE u32 0x574d414e), version 1, header size 96, dtype, ndim, split_dim, shard count, 0, 4 zero bytes,
global shape (8 x i64, -1 past ndim) — the bytes Mooncake stores.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvplugins.mooncake.checks import Typed, i32, text

KINDS = ("dp", "tp", "ep", "pp")  # canonical key order; Mooncake's header codes DP=0 TP=1 EP=2 PP=3
MODES = ("as_stored", "shard", "full")
MAX_AXES = 4
MANIFEST = struct.Struct("<IHHiiiii4x8q")
MANIFEST_MAGIC = 0x574D414E


def _opt_i32(name, value):
    return None if value is None else i32(name, value)


class ParallelAxis:
    """One parallel axis of a tensor shard (Mooncake's ParallelAxis; fields set as attributes, the constructor
    takes no argument). ``kind`` is checked only when a call uses it."""

    __slots__ = ("_kind", "_rank", "_size", "_split_dim", "_expert_id", "_stage_id")
    kind = Typed(text, "")
    rank = Typed(i32, 0)
    size = Typed(i32, 1)
    split_dim = Typed(_opt_i32, None)
    expert_id = Typed(_opt_i32, None)
    stage_id = Typed(_opt_i32, None)


class TensorParallelism:
    """The axes that identify a shard (Mooncake's TensorParallelism). ``axes`` reads as a new list each time, as on
    Mooncake (append to a copy and assign it back)."""

    __slots__ = ("_axes",)

    def __init__(self):
        self._axes = ()

    @property
    def axes(self) -> list:
        return list(self._axes)

    @axes.setter
    def axes(self, value) -> None:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise TypeError(f"TensorParallelism.axes = {value!r:.80}: needs a list of ParallelAxis")
        value = tuple(value)
        if not all(isinstance(a, ParallelAxis) for a in value):
            raise TypeError(f"TensorParallelism.axes = {value!r:.80}: needs a list of ParallelAxis")
        self._axes = value


class ReadTarget:
    """What a read wants (Mooncake's ReadTarget): ``mode`` "as_stored" (default), "shard" or "full" (any case;
    another string raises RuntimeError as on Mooncake), ``parallelism`` a TensorParallelism or None."""

    __slots__ = ("_mode", "_parallelism")

    def __init__(self):
        self._mode, self._parallelism = "as_stored", None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value) -> None:
        value = text("ReadTarget.mode", value).lower()
        if value not in MODES:
            raise RuntimeError(f"Unsupported ReadTarget mode {value!r}: use one of {', '.join(MODES)}")
        self._mode = value

    @property
    def parallelism(self):
        return self._parallelism

    @parallelism.setter
    def parallelism(self, value) -> None:
        if value is not None and not isinstance(value, TensorParallelism):
            raise TypeError(f"ReadTarget.parallelism = {value!r:.80}: needs a TensorParallelism or None")
        self._parallelism = value


@dataclass(frozen=True)
class Axis:
    kind: str
    rank: int
    size: int
    split_dim: int | None = None
    extra: int | None = None  # expert_id (ep) or stage_id (pp)

    def suffix(self) -> str:
        tag = {"tp": "_sd", "ep": "_eid", "pp": "_sid"}.get(self.kind, "")
        value = self.split_dim if self.kind == "tp" else self.extra
        return f"__{self.kind}_{self.rank}of{self.size}" + (f"{tag}{value}" if tag else "")

    def wire(self) -> list:
        return [self.kind, self.rank, self.size, -1 if self.split_dim is None else self.split_dim, self.extra or 0]

    @classmethod
    def from_wire(cls, row) -> "Axis":
        kind, rank, size, sd, extra = row
        return cls(kind, rank, size, None if sd < 0 else sd, extra if kind in ("ep", "pp") else None)


def axes_of(parallelism) -> tuple[Axis, ...]:
    """The validated axes of a TensorParallelism (or any object with ``.axes``). Raises ValueError naming the
    problem (Mooncake: INVALID_PARAMS)."""
    raw = getattr(parallelism, "axes", None)
    if raw is None or isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
        raise ValueError(f"parallelism {parallelism!r:.80} is not a TensorParallelism")
    out = tuple(_axis(a) for a in raw)
    kinds = [a.kind for a in out]
    if not 1 <= len(out) <= MAX_AXES or len(set(kinds)) != len(kinds):
        raise ValueError(f"parallelism axes {kinds}: give 1 to {MAX_AXES} axes, at most one of each kind")
    return out


def _axis(a) -> Axis:
    try:
        kind, rank, size = str(a.kind).lower(), int(a.rank), int(a.size)
        sd, eid, sid = a.split_dim, a.expert_id, a.stage_id
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"{a!r:.80} is not a ParallelAxis: {e}") from e
    if kind not in KINDS or not 0 <= rank < size:
        raise ValueError(f"axis kind={kind!r} rank={rank} size={size}: kind is one of {KINDS}, 0 <= rank < size")
    if (kind == "tp") != (sd is not None):
        raise ValueError(f"axis {kind}: split_dim={sd} (a TP axis needs a split_dim, the others take none)")
    if kind == "ep" and eid is None or kind == "pp" and sid is None:
        raise ValueError(f"axis {kind}: needs {'expert_id' if kind == 'ep' else 'stage_id'}")
    return Axis(
        kind,
        rank,
        size,
        None if sd is None else int(sd),
        int(eid) if kind == "ep" else int(sid) if kind == "pp" else None,
    )


def writer_of(partition) -> Axis:
    """A writer partition (any object with rank, size, split_dim) as a TP axis. Raises ValueError."""
    try:
        rank, size, sd = (int(getattr(partition, f)) for f in ("rank", "size", "split_dim"))
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"writer_partition {partition!r:.80} needs integer rank, size and split_dim") from e
    if not 0 <= rank < size or sd < 0:
        raise ValueError(f"writer_partition rank={rank} size={size} split_dim={sd}: 0 <= rank < size, split_dim >= 0")
    return Axis("tp", rank, size, sd)


def target_of(target) -> tuple[str, tuple[Axis, ...] | None]:
    """(mode, axes or None) of a ReadTarget (None: as_stored). Raises ValueError."""
    if target is None:
        return "as_stored", None
    mode = getattr(target, "mode", None)
    if not isinstance(mode, str) or mode.lower() not in MODES or not hasattr(target, "parallelism"):
        raise ValueError(f"target {target!r:.80} is not a ReadTarget")
    p = target.parallelism
    return mode.lower(), None if p is None else axes_of(p)


def canonical(axes) -> tuple[Axis, ...]:
    return tuple(sorted(axes, key=lambda a: KINDS.index(a.kind)))


def tp_axis(axes) -> Axis | None:
    return next((a for a in axes if a.kind == "tp"), None)


def with_tp(axes, rank: int, size: int) -> tuple[Axis, ...]:
    return tuple(Axis("tp", rank, size, a.split_dim) if a.kind == "tp" else a for a in axes)


def shard_key(key: str, axes) -> str:
    if len(axes) == 1 and axes[0].kind == "tp":
        return f"{key}_tp_{axes[0].rank}"
    return key + "".join(a.suffix() for a in canonical(axes))


def writer_key(key: str, a: Axis) -> str:
    return f"{key}__writer_{a.rank}of{a.size}_sd{a.split_dim}"


def manifest_key(key: str, writer: bool = False) -> str:
    return f"{key}__writer_manifest" if writer else f"{key}__parallelism_manifest"


def manifest(dtype_code: int, shape, split_dim: int, count: int) -> bytes:
    dims = list(shape) + [-1] * (8 - len(shape))
    return MANIFEST.pack(MANIFEST_MAGIC, 1, MANIFEST.size, dtype_code, len(shape), split_dim, count, 0, *dims)


def read_manifest(data) -> tuple[tuple[int, ...], int, int] | None:
    """(global shape, split_dim, shard count) of manifest bytes, or None if they are not one."""
    if data is None or len(data) != MANIFEST.size:
        return None
    magic, version, size, _, ndim, sd, count, _, *dims = MANIFEST.unpack(bytes(data))
    if magic != MANIFEST_MAGIC or version != 1 or size != MANIFEST.size or not 0 <= ndim <= 8 or count < 1:
        return None
    return tuple(dims[:ndim]), sd, count
