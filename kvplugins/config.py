"""One precedence order for every component config, written once: flag > env > file > default.

Each component has one frozen dataclass config decorated with ``@component("name")``. Its fields are the
settings; CLI flags (``--field-name``) and env vars (``KVPLUGINS_<NAME>_<FIELD>``) are derived from them,
so defaults live in exactly one place. Values are typed by the field annotation: ``int``, ``float``,
``str``, ``bool``, or ``Bytes`` (an int of bytes that also accepts "4GiB", "512MiB", "64KiB").

A config file (TOML or JSON) is named by ``--config`` or ``KVPLUGINS_CONFIG``; it holds one table per
component, ``[store]``, ``[master]``, ... Unknown keys in a file, unknown ``KVPLUGINS_<NAME>_*`` env vars
and unparsable values raise ConfigError naming the value, where it came from, and the valid choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

from kvplugins.errors import ConfigError

ENV_PREFIX = "KVPLUGINS_"
CONFIG_FILE_ENV = "KVPLUGINS_CONFIG"
T = TypeVar("T")


class Bytes(int):
    """A size in bytes; parses "4GiB", "512MiB", "4096", "1.5GB"."""


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 1 << 40,
}


def parse_bytes(text: str | int) -> int:
    """Parse a byte size such as "4GiB" (binary) or "4GB" (decimal) into bytes. Raises ConfigError."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{text!r} is not a byte size; write e.g. 4096, 64KiB, 512MiB or 4GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. 4.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def component(name: str):
    """Class decorator: mark a frozen dataclass as the config of component ``name`` (env KVPLUGINS_<NAME>_*)."""

    def wrap(cls):
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        cls._component = name
        return cls

    return wrap


def env_name(cls, field: str) -> str:
    return f"{ENV_PREFIX}{cls._component.upper()}_{field.upper()}"


def _types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, typ: Any, where: str) -> Any:
    origin = typing.get_origin(typ)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        typ = args[0]
    try:
        if typ is Bytes:
            return parse_bytes(value)
        if typ is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if typ is float:
            return float(value)
        if typ is str:
            return str(value)
    except (ValueError, TypeError, ConfigError):
        pass
    else:
        return value
    name = getattr(typ, "__name__", str(typ))
    hint = " (true/false)" if typ is bool else " (e.g. 4GiB)" if typ is Bytes else ""
    raise ConfigError(f"{where}: {value!r} is not a valid {name}{hint}")


def _port(name: str, value: Any, where: str) -> Any:
    """``value`` of a field named ``port`` or ``*_port``, checked to be a TCP port (0 = any free one; -1 = off
    where a field allows it; the field's own check says which). Raises ConfigError naming the value."""
    if (name == "port" or name.endswith("_port")) and type(value) is int and not -1 <= value <= 65535:
        raise ConfigError(f"{where}: port {value} is outside 0-65535 (0 = any free port); pick a port in range")
    return value


def _read_file(path: str | os.PathLike) -> dict:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(
            f"config file {str(p)!r} cannot be read ({e.strerror}); fix {CONFIG_FILE_ENV} or --config"
        ) from e
    try:
        if p.suffix == ".json":
            return json.loads(text)
        return tomllib.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error becomes one clear ConfigError
        raise ConfigError(
            f"config file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {e}"
        ) from e


def _unknown(keys, valid, where: str) -> None:
    bad = sorted(set(keys) - set(valid))
    if bad:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(bad)}; valid keys: {', '.join(sorted(valid))}")


def load(
    cls: type[T],
    flags: Mapping[str, Any] | None = None,
    file: str | os.PathLike | None = None,
    environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    file_extra: Mapping[str, Any] | None = None,
) -> T:
    """Build ``cls`` with precedence flag > env > file > default.

    flags: values from CLI flags or adapter extra-config (None means "not given"); unknown keys raise.
    file: a TOML/JSON file; defaults to env KVPLUGINS_CONFIG. environ: defaults to os.environ.
    A field whose type is itself a component config (an adapter's ``store``: a ClientConfig) is loaded the same
    way with that component's own env and file table: its flag is a mapping (or an instance), the parent's
    file table may hold it as a sub-table (``[vllm.store]``, above ``[client]``), and the parent's default
    instance supplies the defaults that differ (below the file). ``defaults`` and ``file_extra`` are those two
    layers (used for such nested loads).
    Raises ConfigError naming the bad value, its source and the valid keys.
    """
    environ = os.environ if environ is None else environ
    types = _types(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    nested = {n for n in fields if _is_component(types[n])}
    values: dict[str, Any] = {}
    file = file or environ.get(CONFIG_FILE_ENV)
    layers: list[tuple[str, Mapping[str, Any]]] = [("defaults of the parent config", defaults or {})]
    if file:
        section = _read_file(file).get(cls._component, {})
        layers.append((f"config file {file} [{cls._component}]", section))
    layers.append((f"config file {file} (the parent's table of {cls._component} settings)", file_extra or {}))
    for where, layer in layers:  # a nested table in the file is read by _load_nested
        _unknown(layer, fields, where)
        values.update(_values({k: v for k, v in layer.items() if k not in nested}, types, nested, where))
    prefix = f"{ENV_PREFIX}{cls._component.upper()}_"
    env_keys = {k[len(prefix) :].lower(): k for k in environ if k.startswith(prefix)}
    for n in nested:
        inner = [var for key, var in env_keys.items() if key.startswith(f"{n}_")]
        if inner:
            raise ConfigError(
                f"environment {inner[0]}: the {n} settings take the {types[n]._component} "
                f"variables: {ENV_PREFIX}{types[n]._component.upper()}_<SETTING>"
            )
    _unknown(env_keys, fields - nested, f"environment ({prefix}*)")
    for k, var in env_keys.items():
        values[k] = _port(k, _coerce(environ[var], types[k], f"env {var}"), f"env {var}")
    flags = {k.replace("-", "_"): v for k, v in (flags or {}).items() if v is not None}
    for n in nested:
        inner = sorted(k for k in flags if k not in fields and k in {f.name for f in dataclasses.fields(types[n])})
        if inner:
            raise ConfigError(
                f"{cls._component} options: {', '.join(inner)} belong in the {n} section: write "
                f'{{"{n}": {{"{inner[0]}": ...}}}} (every {types[n]._component} setting is '
                f"there)"
            )
    _unknown(flags, fields, f"{cls._component} options")
    values.update(_values(flags, types, nested, f"{cls._component} option"))
    for n in nested:
        values[n] = _load_nested(cls, n, types[n], values, file, environ)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{cls._component} config: {e}") from e


def _is_component(typ: Any) -> bool:
    return isinstance(typ, type) and dataclasses.is_dataclass(typ) and hasattr(typ, "_component")


def _values(layer: Mapping[str, Any], types: dict[str, Any], nested: set[str], where: str) -> dict[str, Any]:
    """A layer's values coerced to the field types; a nested component's value is kept (a mapping or an
    instance) under its name, for _load_nested."""
    out: dict[str, Any] = {}
    for k, v in layer.items():
        if k in nested:
            if not isinstance(v, (Mapping, types[k])):
                raise ConfigError(
                    f"{where} {k}: {v!r:.60} is not a table of {types[k]._component} settings; "
                    f'write e.g. {{"{k}": {{"master": "host:port"}}}}'
                )
            out[k] = v
        else:
            out[k] = _port(k, _coerce(v, types[k], f"{where} {k}"), f"{where} {k}")
    return out


def _load_nested(cls: Any, name: str, sub: Any, values: dict[str, Any], file: Any, environ: Mapping[str, str]) -> Any:
    """Field ``name`` of ``cls`` (component ``sub``): an instance given as is, else loaded with the parent's
    default instance's differing values below the file, the parent's sub-table above ``[sub]``, the sub's
    env, then the given mapping."""
    given = values.get(name)
    if isinstance(given, sub):
        return given
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    parent_default = f.default_factory() if f.default_factory is not dataclasses.MISSING else sub()
    base = sub()
    differ = {
        g.name: getattr(parent_default, g.name)
        for g in dataclasses.fields(sub)
        if g.init and getattr(parent_default, g.name) != getattr(base, g.name)
    }
    sub_file = (_read_file(file).get(cls._component, {}).get(name) or {}) if file else {}
    return load(sub, flags=given or None, file=file, environ=environ, defaults=differ, file_extra=sub_file)


def add_arguments(
    parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (), common: tuple[str, ...] | None = None
) -> None:
    """Add ``--field-name`` flags for every field of ``cls``; each flag's default is None (= not given)
    and its help shows the dataclass default and the env var, so defaults live only in the dataclass. With
    ``common``, those fields are listed first (the parser's options) and the others under a group of their own
    after them ("advanced [component] settings"), so ``--help`` starts with what most runs set."""
    types = _types(cls)
    advanced = (
        parser
        if common is None
        else parser.add_argument_group(
            f"advanced [{cls._component}] settings (also env {ENV_PREFIX}{cls._component.upper()}_*, or the config "
            "file)"
        )
    )
    for f in dataclasses.fields(cls):
        if not f.init or f.name in skip or _is_component(types[f.name]):
            continue
        target = parser if common is None or f.name in common else advanced
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = format_bytes(default) if types[f.name] is Bytes and default is not None else default
        help_ = f"{f.metadata.get('help', '')} (default: {shown}; env {env_name(cls, f.name)})".strip()
        flag = "--" + f.name.replace("_", "-")
        if types[f.name] is bool and f.name.startswith("no_"):  # --no-pool, never --no-no-pool
            target.add_argument(flag, dest=f.name, default=None, action="store_const", const=True, help=help_)
        elif types[f.name] is bool:
            target.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_)
        else:
            target.add_argument(flag, dest=f.name, default=None, help=help_)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """load() with the fields of ``cls`` taken from parsed CLI args and the file from --config."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    flags = {k: v for k, v in vars(args).items() if k in names}
    return load(cls, flags, getattr(args, "config", None))
