"""Lazy package attributes, so that importing a package stays cheap (no transfer engine, no zmq) until a name is
used: ``__getattr__ = lazy(__name__, {"StoreClient": "kvplugins.store.client.store_client"})`` (PEP 562)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` giving each of ``names`` (name -> module defining it) from its module on first
    use; any other name raises AttributeError as Python does."""

    def getattr_(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return getattr_
