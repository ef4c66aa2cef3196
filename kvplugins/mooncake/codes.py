"""Mooncake 0.3.13's ErrorCode values (``types.h``) and the one place where our exceptions become them: the
Mooncake-compatible layer (api.py, extra.py) answers integer codes, as Mooncake's Python API does.
``pybind`` checks a call's arguments first, as Mooncake's pybind11 binding does: a missing, unknown or mistyped
argument raises TypeError (checks.py), it never becomes a code."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sized
from typing import Concatenate, ParamSpec, Protocol, TypeVar, overload

from kvplugins.errors import (
    BufferNotRegistered,
    ConfigError,
    KeyNotFound,
    KVPluginsError,
    MasterUnreachable,
    PutPending,
    SizeMismatch,
    StoreFull,
    TransferError,
)
from kvplugins.mooncake import checks

log = logging.getLogger("kvplugins.mooncake.api")

OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
E = TypeVar("E")
E_co = TypeVar("E_co", covariant=True)


def pybind(fn: Callable[P, R]) -> Callable[P, R]:
    """Check each call of method ``fn`` as pybind11 would (checks.check_call): the converters come from
    the parameters' annotations (checks.ARGS; a ``*args: Buffer`` converts every element)."""
    sig = inspect.signature(fn)
    casts: dict[str, checks.Convert | checks.ConvertEach] = {}
    for name, p in sig.parameters.items():
        convert = checks.ARGS.get(p.annotation) or _config_arg(p.annotation)
        if convert is not None and p.kind == p.VAR_POSITIONAL:
            convert = _each(convert)
        if convert is not None:
            casts[name] = convert

    @functools.wraps(fn)
    def method(*args: P.args, **kwargs: P.kwargs) -> R:
        bound = checks.check_call(fn, sig, casts, args, kwargs)
        return fn(*bound.args, **bound.kwargs)

    return method


def _config_arg(annotation: object) -> checks.Convert | None:
    if annotation == "ReplicateConfig":
        return checks.instance_of(checks.ReplicateConfig)
    return None


def _each(convert: checks.Convert) -> checks.ConvertEach:
    return lambda name, values: tuple(convert(name, v) for v in values)


def code_of(err: BaseException | None, *_: object) -> int:
    """The Mooncake ErrorCode value for one of our errors (None -> 0)."""
    if err is None:
        return OK
    for cls, code in (
        (KeyNotFound, OBJECT_NOT_FOUND),
        (StoreFull, NO_AVAILABLE_HANDLE),
        (PutPending, REPLICA_IS_NOT_READY),
        (MasterUnreachable, RPC_FAIL),
        (BufferNotRegistered, INVALID_PARAMS),
        (SizeMismatch, INVALID_PARAMS),
        (ConfigError, INVALID_PARAMS),
        (ValueError, INVALID_PARAMS),
        (TypeError, INVALID_PARAMS),
        (TransferError, TRANSFER_FAIL),
    ):
        if isinstance(err, cls):
            return code
    return INTERNAL_ERROR


class Guard(Protocol[E_co]):
    """What ``guard(on_error)`` gives: a decorator whose method answers its own result or ``on_error``'s."""

    def __call__(self, fn: Callable[Concatenate[S, P], R], /) -> Callable[Concatenate[S, P], R | E_co]: ...


@overload
def guard() -> Guard[int]: ...
@overload
def guard(on_error: Callable[..., E]) -> Guard[E]: ...
def guard(on_error: Callable[..., object] = code_of) -> Guard[object]:
    """Run the method; an exception becomes ``on_error(exception, *args)`` (its code by default)."""

    def wrap(fn: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], object]:
        @functools.wraps(fn)
        def method(self: S, /, *args: P.args, **kwargs: P.kwargs) -> object:
            try:
                return fn(self, *args, **kwargs)
            except (KVPluginsError, ValueError, TypeError, OSError) as e:
                log.warning("%s failed: %s", fn.__name__, e)
                return on_error(e, *args)

        return method

    return wrap


def per_key(err: BaseException, keys: Sized = (), *_: object) -> list[int]:
    """on_error of the batch forms: the code once per key."""
    return [code_of(err)] * len(keys)
