"""CPU expert backend for hybrid MoE: ``KTMoEWrapper`` (kt-kernel 0.7.2's API, SGLang's ``--kt-*`` flags) on the
native kernels of ``kvplugins._moe``. Importing this package imports no torch; the wrapper does, lazily."""

from __future__ import annotations

from kvplugins.lazy import lazy

__all__ = ["KTMoEWrapper"]
__getattr__ = lazy(__name__, {"KTMoEWrapper": "kvplugins.kt_expert_backend.wrapper"})
