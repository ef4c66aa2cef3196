"""pybind11's argument conversions as Mooncake 0.3.13's bindings apply them to ReplicateConfig's attributes, so
a value Mooncake refuses raises TypeError here too, on assignment (issue #19). Checked side by side against the
installed mooncake-transfer-engine wheel in tests/store/test_compat.py. Rules followed (pybind11 type casters in
convert mode, as the wheel's property setters use them):

- unsigned 64-bit integers: anything with ``__index__`` or ``__int__`` except float, str and bytes, in
  [0, 2**64); bool and numpy integers count (True -> 1);
- bool: True/False, None (False), and any number (``__bool__``), but not str, sequences or enums;
- str: str, or bytes (decoded as UTF-8);
- list[str]: any sequence but a string, of str, stored as a list;
- enums: only the enum's own members.
"""
from __future__ import annotations

import enum


def u64(name: str, value, optional: bool = False):
    if value is None and optional:
        return None
    kind = type(value)
    ok = not isinstance(value, (float, str, bytes, bytearray)) and (
        hasattr(kind, "__index__") or hasattr(kind, "__int__"))
    number = int(value) if ok else None
    if number is None or not 0 <= number < 1 << 64:
        raise TypeError(f"ReplicateConfig.{name} = {value!r}: needs an unsigned 64-bit integer"
                        f"{' or None' if optional else ''} (as Mooncake's binding)")
    return number


def boolean(name: str, value) -> bool:
    if value is None:
        return False
    if isinstance(value, (str, bytes, bytearray, enum.Enum)) or not hasattr(type(value), "__bool__"):
        raise TypeError(f"ReplicateConfig.{name} = {value!r}: needs a bool (as Mooncake's binding)")
    return bool(value)


def text(name: str, value) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode()
    if not isinstance(value, str):
        raise TypeError(f"ReplicateConfig.{name} = {value!r}: needs a str (as Mooncake's binding)")
    return value


def texts(name: str, value, optional: bool = False):
    if value is None and optional:
        return None
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"ReplicateConfig.{name} = {value!r}: needs a list of str (as Mooncake's binding)")
    return [text(name, v) for v in value]


def member(enum_type):
    def convert(name: str, value):
        if not isinstance(value, enum_type):
            raise TypeError(f"ReplicateConfig.{name} = {value!r}: needs a {enum_type.__name__} member "
                            f"({', '.join(m.name for m in enum_type)})")
        return value
    return convert


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
