"""Opt-in import shims: after ``kvplugins kt enable`` / ``kvplugins mooncake enable``, an engine's unchanged
``import kt_kernel`` / ``from mooncake.store import MooncakeDistributedStore`` gets kvplugins' implementation.

How: the shim package lives in a directory of our own inside site-packages, put first on sys.path by a
``kvplugins-<name>-shim.pth`` file. A real installation is never touched: enable refuses while one is importable
unless ``force`` (then the shim shadows it), and ``disable`` deletes the .pth and the shim directory (refusing a
directory without our marker), which brings the real one back.
"""

from __future__ import annotations

import importlib.util
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from kvplugins.errors import ConfigError


@dataclass(frozen=True)
class Status:
    shim: "Shim"
    enabled: bool
    site_dir: str
    real: str | None  # where a real installation of the package is, if any

    @property
    def real_kt_kernel(self) -> str | None:  # the kt shim's name for it (kept for its callers)
        return self.real

    def describe(self) -> str:
        s = self.shim
        real = f"real {s.dist} at {self.real}" if self.real else f"no real {s.dist} installed"
        state = f"enabled: {s.effect}" if self.enabled else "disabled"
        shadow = " (shadowing it)" if self.enabled and self.real else ""
        return f"{s.name} shim {state}{shadow}; {real}; site dir {self.site_dir}"


@dataclass(frozen=True)
class Shim:
    """One shim: package ``package`` (files: path inside it -> source; each starts with the marker line)."""

    name: str  # the CLI word: kvplugins NAME enable
    package: str  # the import name it provides
    dist: str  # the real distribution's name, for messages (pip uninstall DIST)
    effect: str  # what enabling does, for status
    files: tuple  # ((relative path, source), ...)

    @property
    def marker(self) -> str:
        return f"# kvplugins {self.name} shim"

    @property
    def pth(self) -> str:
        return f"kvplugins-{self.name}-shim.pth"

    @property
    def shim_dir(self) -> str:
        return f"kvplugins_{self.name}_shim"

    def real(self, site_dir: Path) -> str | None:
        """Path of a ``package`` that is not this shim: in ``site_dir`` or anywhere importable."""
        local = site_dir / self.package
        if local.exists():
            return str(local)
        spec = importlib.util.find_spec(self.package)
        if spec is None:
            return None
        paths = [Path(p) for p in (spec.submodule_search_locations or [])] or (
            [Path(spec.origin).parent] if spec.origin else []
        )
        real = [p for p in paths if p.parent.name != self.shim_dir]
        return str(real[0]) if real else None

    def status(self, site_dir: Path | None = None) -> Status:
        site_dir = Path(site_dir or default_site_dir())
        enabled = (site_dir / self.pth).exists() and all(
            (site_dir / self.shim_dir / self.package / rel).exists() for rel, _ in self.files
        )
        return Status(self, enabled, str(site_dir), self.real(site_dir))

    def enable(self, site_dir: Path | None = None, force: bool = False) -> Status:
        """Install the shim. Raises ConfigError if a real package is installed and not ``force``."""
        site_dir = Path(site_dir or default_site_dir())
        real = self.real(site_dir)
        if real and not force:
            raise ConfigError(
                f"a real {self.dist} is installed at {real}; the kvplugins shim would shadow it. "
                f"Uninstall it (pip uninstall {self.dist}) or run `kvplugins {self.name} enable "
                f"--force` (`kvplugins {self.name} disable` brings it back)"
            )
        pkg = site_dir / self.shim_dir / self.package
        pkg.mkdir(parents=True, exist_ok=True)
        for rel, source in self.files:
            (pkg / rel).write_text(f"{self.marker}: `kvplugins {self.name} disable` removes this package.\n{source}")
        (site_dir / self.pth).write_text(f"import sys; sys.path.insert(0, {str(site_dir / self.shim_dir)!r})\n")
        return self.status(site_dir)

    def disable(self, site_dir: Path | None = None) -> Status:
        """Remove the shim (idempotent). Refuses to delete a shim directory that lacks our marker."""
        site_dir = Path(site_dir or default_site_dir())
        (site_dir / self.pth).unlink(missing_ok=True)
        for rel, _ in self.files:
            f = site_dir / self.shim_dir / self.package / rel
            if f.exists() and not f.read_text().startswith(self.marker):
                raise ConfigError(f"{f} is not a kvplugins shim; not deleting it")
        shutil.rmtree(site_dir / self.shim_dir, ignore_errors=True)
        return self.status(site_dir)


def default_site_dir() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def add_commands(subparsers, shim_name: str, package_text: str) -> None:
    """The enable / disable / status subcommands of ``kvplugins SHIM_NAME`` (--site-dir; --force on enable)."""
    for name, help_ in (
        ("enable", f"make {package_text} use kvplugins"),
        ("disable", f"remove the {shim_name} shim"),
        ("status", "show the shim state"),
    ):
        c = subparsers.add_parser(name, help=help_)
        where = {"enable": "to install the shim into", "disable": "to remove the shim from", "status": "to look in"}[
            name
        ]
        c.add_argument("--site-dir", help=f"site-packages {where} (default: this interpreter's)")
        if name == "enable":
            c.add_argument("--force", action="store_true", help=f"shadow a real installation of {package_text}")


def run_command(shim: Shim, command: str, args) -> Status:
    """Run enable / disable / status; returns the Status after it."""
    if command == "enable":
        return shim.enable(args.site_dir, force=args.force)
    return shim.disable(args.site_dir) if command == "disable" else shim.status(args.site_dir)
