"""Mooncake 0.3.13's ErrorCode values (``types.h``) and the one place where our exceptions become them: the
Mooncake-compatible layer (api.py, extra.py) answers integer codes, as Mooncake's Python API does.
``pybind`` checks a call's arguments first, as Mooncake's pybind11 binding does: a missing, unknown or mistyped
argument raises TypeError (checks.py), it never becomes a code."""
from __future__ import annotations

import functools
import inspect
import logging

from kvplugins.errors import (BufferNotRegistered, ConfigError, KeyNotFound, KVPluginsError, MasterUnreachable,
                              PutPending, SizeMismatch, StoreFull, TransferError)
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


def pybind(fn):
    """Check each call of method ``fn`` as pybind11 would (checks.check_call): the converters come from
    the parameters' annotations (checks.ARGS; a ``*args: Buffer`` converts every element)."""
    sig = inspect.signature(fn)
    casts = {}
    for name, p in sig.parameters.items():
        convert = checks.ARGS.get(p.annotation) or _config_arg(p.annotation)
        if convert is not None and p.kind == p.VAR_POSITIONAL:
            convert = _each(convert)
        if convert is not None:
            casts[name] = convert

    @functools.wraps(fn)
    def method(*args, **kwargs):
        bound = checks.check_call(fn, sig, casts, args, kwargs)
        return fn(*bound.args, **bound.kwargs)
    return method


def _config_arg(annotation):
    if annotation == "ReplicateConfig":
        return checks.instance_of(checks.ReplicateConfig)
    return None


def _each(convert):
    return lambda name, values: tuple(convert(name, v) for v in values)


def code_of(err: BaseException | None, *_) -> int:
    """The Mooncake ErrorCode value for one of our errors (None -> 0)."""
    if err is None:
        return OK
    for cls, code in ((KeyNotFound, OBJECT_NOT_FOUND), (StoreFull, NO_AVAILABLE_HANDLE),
                      (PutPending, REPLICA_IS_NOT_READY), (MasterUnreachable, RPC_FAIL),
                      (BufferNotRegistered, INVALID_PARAMS),
                      (SizeMismatch, INVALID_PARAMS), (ConfigError, INVALID_PARAMS), (ValueError, INVALID_PARAMS),
                      (TypeError, INVALID_PARAMS), (TransferError, TRANSFER_FAIL)):
        if isinstance(err, cls):
            return code
    return INTERNAL_ERROR


def guard(on_error=code_of):
    """Run the method; an exception becomes ``on_error(exception, *args)`` (its code by default)."""
    def wrap(fn):
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except (KVPluginsError, ValueError, TypeError, OSError) as e:
                log.warning("%s failed: %s", fn.__name__, e)
                return on_error(e, *args)
        return method
    return wrap


def per_key(err, keys=(), *_):
    """on_error of the batch forms: the code once per key."""
    return [code_of(err)] * len(keys)
