"""The opt-in ``kt_kernel`` shim (kvplugins/shims.py): after ``kvplugins kt enable``, SGLang's
``from kt_kernel import KTMoEWrapper`` gets kvplugins' wrapper, so the unchanged ``--kt-*`` flags run our
backend. ``enable(site_dir, force)``, ``disable(site_dir)``, ``status(site_dir)``."""

from __future__ import annotations

from kvplugins.shims import Shim

SHIM = Shim(
    "kt",
    "kt_kernel",
    "kt-kernel",
    "`import kt_kernel` gives kvplugins' KTMoEWrapper",
    (
        (
            "__init__.py",
            '''\
"""kt_kernel API served by kvplugins.kt_expert_backend (see docs/kt.md)."""
from kvplugins.kt_expert_backend import KTMoEWrapper
from kvplugins.kt_expert_backend.native import kt_cpu_variant as _kt_cpu_variant

__version__ = "0.7.2+kvplugins"
__cpu_variant__ = _kt_cpu_variant()
__all__ = ["KTMoEWrapper"]
''',
        ),
    ),
)
enable, disable, status = SHIM.enable, SHIM.disable, SHIM.status
