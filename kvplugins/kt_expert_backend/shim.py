"""The opt-in ``kt_kernel`` shim: after ``kvplugins kt enable``, SGLang's ``from kt_kernel import KTMoEWrapper``
gets kvplugins' wrapper, so the unchanged ``--kt-*`` flags run our backend.

How: a package ``kt_kernel`` (re-exporting kvplugins.kt_expert_backend) in a directory of our own inside
site-packages, put first on sys.path by a ``kvplugins-kt-shim.pth`` file. A real kt-kernel is never touched: enable
refuses while one is importable unless ``force`` (then the shim shadows it), and ``disable`` deletes the .pth and
the shim directory, which brings the real one back.
"""
from __future__ import annotations

import importlib.util
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from kvplugins.errors import ConfigError

PTH = "kvplugins-kt-shim.pth"
SHIM_DIR = "kvplugins_kt_shim"
MARKER = "# kvplugins kt shim"
SHIM_SOURCE = f'''{MARKER}: `kvplugins kt disable` removes this package.
"""kt_kernel API served by kvplugins.kt_expert_backend (see docs/kt.md)."""
from kvplugins.kt_expert_backend import KTMoEWrapper
from kvplugins.kt_expert_backend.native import kt_cpu_variant as _kt_cpu_variant

__version__ = "0.7.2+kvplugins"
__cpu_variant__ = _kt_cpu_variant()
__all__ = ["KTMoEWrapper"]
'''


@dataclass(frozen=True)
class Status:
    enabled: bool
    site_dir: str
    real_kt_kernel: str | None  # where a real kt-kernel is installed, if any

    def describe(self) -> str:
        real = f"real kt-kernel at {self.real_kt_kernel}" if self.real_kt_kernel else "no real kt-kernel installed"
        state = "enabled: `import kt_kernel` gives kvplugins' KTMoEWrapper" if self.enabled else "disabled"
        shadow = " (shadowing it)" if self.enabled and self.real_kt_kernel else ""
        return f"kt shim {state}{shadow}; {real}; site dir {self.site_dir}"


def default_site_dir() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def real_kt_kernel(site_dir: Path) -> str | None:
    """Path of a kt_kernel package that is not our shim: in ``site_dir`` or anywhere importable."""
    local = site_dir / "kt_kernel"
    if local.exists():
        return str(local)
    spec = importlib.util.find_spec("kt_kernel")
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin)
    if origin.parent.parent.name == SHIM_DIR:
        return None
    return str(origin.parent)


def status(site_dir: Path | None = None) -> Status:
    site_dir = Path(site_dir or default_site_dir())
    enabled = (site_dir / PTH).exists() and (site_dir / SHIM_DIR / "kt_kernel" / "__init__.py").exists()
    return Status(enabled, str(site_dir), real_kt_kernel(site_dir))


def enable(site_dir: Path | None = None, force: bool = False) -> Status:
    """Install the shim. Raises ConfigError if a real kt-kernel is installed and not ``force``."""
    site_dir = Path(site_dir or default_site_dir())
    real = real_kt_kernel(site_dir)
    if real and not force:
        raise ConfigError(f"a real kt-kernel is installed at {real}; the kvplugins shim would shadow it. "
                          "Uninstall it (pip uninstall kt-kernel) or run `kvplugins kt enable --force` "
                          "(`kvplugins kt disable` brings it back)")
    pkg = site_dir / SHIM_DIR / "kt_kernel"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(SHIM_SOURCE)
    shim_root = str(site_dir / SHIM_DIR)
    (site_dir / PTH).write_text(f"import sys; sys.path.insert(0, {shim_root!r})\n")
    return status(site_dir)


def disable(site_dir: Path | None = None) -> Status:
    """Remove the shim (idempotent). Refuses to delete a shim directory that lacks our marker."""
    site_dir = Path(site_dir or default_site_dir())
    (site_dir / PTH).unlink(missing_ok=True)
    init = site_dir / SHIM_DIR / "kt_kernel" / "__init__.py"
    if init.exists() and not init.read_text().startswith(MARKER):
        raise ConfigError(f"{init} is not a kvplugins shim; not deleting it")
    shutil.rmtree(site_dir / SHIM_DIR, ignore_errors=True)
    return status(site_dir)
