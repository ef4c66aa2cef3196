"""CPU expert backend for hybrid MoE: ``KTMoEWrapper`` (kt-kernel 0.7.2's API, SGLang's ``--kt-*`` flags) on the
native kernels of ``kvplugins._moe``. Importing this package imports no torch; the wrapper does, lazily."""
from __future__ import annotations


def __getattr__(name):
    if name == "KTMoEWrapper":
        from kvplugins.kt_expert_backend.wrapper import KTMoEWrapper
        return KTMoEWrapper
    raise AttributeError(name)


__all__ = ["KTMoEWrapper"]
