"""pybind11's argument conversions as Mooncake 0.3.13's bindings apply them, to ReplicateConfig's attributes (on
assignment) and to every MooncakeDistributedStore method's arguments (``check_call``), so a value or a call
Mooncake refuses raises TypeError here too, never a return code (issue #19). Checked side by side against the
installed mooncake-transfer-engine wheel in tests/store/test_mooncake_api.py. Rules followed (pybind11 type casters in
convert mode, as the wheel's bindings use them):

- unsigned 64-bit integers: anything with ``__index__`` or ``__int__`` except float, str and bytes, in
  [0, 2**64); bool and numpy integers count (True -> 1);
- bool: True/False, None (False), and any number (``__bool__``), but not str, sequences or enums;
- str: str, or bytes (decoded as UTF-8);
- list[str]: any sequence but a string, of str, stored as a list;
- enums: only the enum's own members;
- Buffer (``put``'s value): anything with the buffer protocol (bytes, bytearray, memoryview, numpy arrays), not str;
- list[...]: any sequence but str/bytes (a tuple too), each element converted;
- a ReplicateConfig argument: a ReplicateConfig (not None).
"""

from __future__ import annotations

import enum
import inspect
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, ParamSpec

from kvplugins.errors import ConfigError

if TYPE_CHECKING:
    from kvplugins.store.placement import PutConfig

Convert = Callable[[str, object], object]  # an argument's conversion: (its name, value) -> value
ConvertEach = Callable[[str, Iterable[object]], object]  # the same of each element of a ``*args``
P = ParamSpec("P")


def u64(name: str, value, optional: bool = False):
    if value is None and optional:
        return None
    kind = type(value)
    ok = not isinstance(value, (float, str, bytes, bytearray)) and (
        hasattr(kind, "__index__") or hasattr(kind, "__int__")
    )
    number = int(value) if ok else None
    if number is None or not 0 <= number < 1 << 64:
        raise TypeError(
            f"{_owner(name)} = {value!r:.80}: needs an unsigned 64-bit integer"
            f"{' or None' if optional else ''} (as Mooncake's binding)"
        )
    return number


def i32(name: str, value) -> int:
    """pybind11's C++ int: anything with ``__index__`` or ``__int__`` except float, str and bytes, in 32 bits."""
    kind = type(value)
    ok = not isinstance(value, (float, str, bytes, bytearray)) and (
        hasattr(kind, "__index__") or hasattr(kind, "__int__")
    )
    number = int(value) if ok else None
    if number is None or not -(1 << 31) <= number < 1 << 31:
        raise TypeError(f"{_owner(name)} = {value!r:.80}: needs a 32-bit integer (as Mooncake's binding)")
    return number


def uuid_pair(name: str, value) -> tuple[int, int]:
    """Mooncake's UUID argument: a sequence of exactly two unsigned 64-bit ints (a tuple or a list)."""
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(
            f"{_owner(name)} = {value!r:.80}: needs a task id, a pair of unsigned 64-bit integers "
            "(as Mooncake's binding)"
        )
    return u64(name, value[0]), u64(name, value[1])


def boolean(name: str, value) -> bool:
    if value is None:
        return False
    if isinstance(value, (str, bytes, bytearray, enum.Enum)) or not hasattr(type(value), "__bool__"):
        raise TypeError(f"{_owner(name)} = {value!r:.80}: needs a bool (as Mooncake's binding)")
    return bool(value)


def text(name: str, value) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode()
    if not isinstance(value, str):
        raise TypeError(f"{_owner(name)} = {value!r:.80}: needs a str (as Mooncake's binding)")
    return value


def texts(name: str, value, optional: bool = False):
    if value is None and optional:
        return None
    return listed(text, "str")(name, value)


def member(enum_type):
    def convert(name: str, value):
        if not isinstance(value, enum_type):
            raise TypeError(
                f"{_owner(name)} = {value!r:.80}: needs a {enum_type.__name__} member "
                f"({', '.join(m.name for m in enum_type)})"
            )
        return value

    return convert


def listed(convert, what: str):
    """The converter of a list of ``what``: any sequence but a string, each element through ``convert``."""

    def convert_list(name: str, value):
        if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
            raise TypeError(f"{_owner(name)} = {value!r:.80}: needs a list of {what} (as Mooncake's binding)")
        return [convert(name, v) for v in value]

    return convert_list


def buffer(name: str, value):
    """pybind11's py::buffer: anything with the buffer protocol, as is."""
    try:
        memoryview(value)
    except TypeError:
        raise TypeError(
            f"{name} = {value!r:.80}: needs a buffer (bytes, bytearray, memoryview, numpy array; as Mooncake's binding)"
        ) from None
    return value


def _owner(name: str) -> str:
    """The argument or attribute a message names: 'put(): key' as is, a bare attribute as ReplicateConfig.name."""
    return name if "(" in name or "." in name else f"ReplicateConfig.{name}"


def instance_of(cls: type) -> Convert:
    def convert(name: str, value: object) -> object:
        if not isinstance(value, cls) and value is not DEFAULT:
            raise TypeError(f"{name} = {value!r:.80}: needs a {cls.__name__} (as Mooncake's binding; None is refused)")
        return value

    return convert


def same_length(*lists) -> None:
    """Raise ValueError (INVALID_PARAMS) unless the parallel argument lists (keys, pointers, sizes) line up."""
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"keys, buffer pointers and sizes must have the same length, got {[len(x) for x in lists]}")


def check_call(
    fn: Callable[P, object],
    sig: inspect.Signature,
    casts: dict[str, Convert | ConvertEach],
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> inspect.BoundArguments:
    """Bind ``args``/``kwargs`` to ``sig`` (the method's signature) and convert each argument named in ``casts``
    (name -> converter). Raises TypeError as pybind11 does for a missing, unknown or mistyped argument."""
    method = fn.__name__.lstrip("_")
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"{method}(): incompatible function arguments ({e}); the supported form is {method}{sig}"
        ) from None
    for name, convert in casts.items():
        if name in bound.arguments:
            bound.arguments[name] = convert(f"{method}(): {name}", bound.arguments[name])
    return bound


class Typed:
    """A ReplicateConfig attribute whose assignment goes through ``convert(name, value)``."""

    def __init__(self, convert, default):
        self.convert, self.default = convert, default

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj, self.slot, self.default)

    def __set__(self, obj, value) -> None:
        setattr(obj, self.slot, self.convert(self.name, value))


class SoftPinAction(enum.IntEnum):
    """Mooncake's ReplicateConfig.soft_pin_action."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """Mooncake's ReplicateConfig.data_type (accepted, not used)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicateConfig:
    """Mooncake's ReplicateConfig: the attributes of 0.3.13 with their defaults, typed as its binding types them
    (a value Mooncake refuses raises TypeError on assignment; an unknown attribute raises AttributeError;
    compat_py). Used: ``replica_num``, ``with_hard_pin``, ``soft_pin_action`` = ENABLE
    (+ ``soft_pin_ttl_ms``), ``preferred_segment`` (a segment name as ``kvplugins status`` lists it) or the
    first ``preferred_segments``. The others are accepted for compatibility and ignored. ``with_soft_pin`` is
    ours (Mooncake 0.3.13 has no such attribute): the same as soft_pin_action = ENABLE."""

    __slots__ = (
        "_replica_num",
        "_with_hard_pin",
        "_with_soft_pin",
        "_soft_pin_action",
        "_soft_pin_ttl_ms",
        "_preferred_segment",
        "_preferred_segments",
        "_prefer_alloc_in_same_node",
        "_preferred_nof_segments",
        "_nof_replica_num",
        "_dfs_replica_num",
        "_group_ids",
        "_data_type",
    )
    replica_num = Typed(u64, 1)
    with_hard_pin = Typed(boolean, False)
    with_soft_pin = Typed(boolean, False)
    soft_pin_action = Typed(member(SoftPinAction), SoftPinAction.PRESERVE)
    soft_pin_ttl_ms = Typed(lambda n, v: u64(n, v, optional=True), None)
    preferred_segment = Typed(text, "")
    preferred_segments = Typed(texts, ())
    prefer_alloc_in_same_node = Typed(boolean, False)
    preferred_nof_segments = Typed(texts, ())
    nof_replica_num = Typed(u64, 0)
    dfs_replica_num = Typed(u64, 0)
    group_ids = Typed(lambda n, v: texts(n, v, optional=True), None)
    data_type = Typed(member(ObjectDataType), ObjectDataType.UNKNOWN)

    def __init__(self):
        self.preferred_segments, self.preferred_nof_segments = [], []  # a list of its own per config

    def to_put_config(self, defaults: PutConfig) -> PutConfig:
        """The PutConfig (store/placement.py) of this config; ``defaults``: the client's default PutConfig.
        Raises ConfigError for a bad value."""
        from kvplugins.store.placement import PutConfig

        soft = self.with_soft_pin or self.soft_pin_action == SoftPinAction.ENABLE
        if self.soft_pin_ttl_ms is not None and not soft:
            raise ConfigError(
                f"soft_pin_ttl_ms={self.soft_pin_ttl_ms} with soft_pin_action="
                f"{self.soft_pin_action.name}: a soft-pin TTL needs soft_pin_action = "
                "SoftPinAction.ENABLE (Mooncake: -600)"
            )
        pin = "hard" if self.with_hard_pin else "soft" if soft else "none"
        return PutConfig(
            replicas=self.replica_num,
            pin=pin,
            preferred_segment=self.preferred_segment or next(iter(self.preferred_segments), ""),
            pin_ttl_ms=self.soft_pin_ttl_ms or defaults.pin_ttl_ms,
        )

    def __repr__(self) -> str:
        return (
            f"ReplicateConfig(replica_num={self.replica_num}, with_hard_pin={self.with_hard_pin}, "
            f"with_soft_pin={self.with_soft_pin}, preferred_segment={self.preferred_segment!r})"
        )


# Annotation names of the API's parameters that are not Python types (the methods' modules import them, so a
# type checker and linter know them; pybind checks by the annotation's text, ARGS below).
I32 = int  # a C int32 argument: range-checked as pybind11 does
Buffer = object  # anything with the buffer protocol (bytes, bytearray, memoryview, numpy arrays), not str

# Converters of method arguments by annotation (api.py annotates parameters with these names).
ARGS = {
    "str": text,
    "int": u64,
    "I32": i32,
    "bool": boolean,
    "tuple[int, int]": uuid_pair,
    "Buffer": buffer,
    "list[str]": listed(text, "str"),
    "list[int]": listed(u64, "int"),
    "list[Buffer]": listed(buffer, "buffer"),
    "list[list[int]]": listed(listed(u64, "int"), "list of int"),
    "list[list[str]]": listed(listed(text, "str"), "list of str"),
    "list[list[list[int]]]": listed(listed(listed(u64, "int"), "list of int"), "list of lists of int"),
}


class _Default:
    """The default ``config`` of a put-like method (a ReplicateConfig with every default)."""

    def __repr__(self) -> str:
        return "<default ReplicateConfig>"


if TYPE_CHECKING:
    DEFAULT: ReplicateConfig  # to a type checker, what it stands for: a config with every default (`is` tests it)
else:
    DEFAULT = _Default()
_SIZE = re.compile(r"\s*(\d+)\s*([kmgt]?b?)\s*", re.I)
_UNIT = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
}


def byte_size(name: str, text: str) -> int:
    """A size string as Mooncake 0.3.13 reads one (utils.h try_string_to_byte_size): digits, then an optional
    unit B/KB/MB/GB/TB in any case, binary (16MB = 16 MiB), spaces allowed. Raises ConfigError otherwise."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise ConfigError(
            f"{name}={text!r}: write a size as Mooncake reads it, e.g. 16777216, '16MB' or '16 MB' "
            "(binary units; MiB is not accepted)"
        )
    return int(m.group(1)) * _UNIT[m.group(2).lower()]
