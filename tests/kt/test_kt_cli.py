"""`kvplugins kt enable|disable|status` (the kt_kernel shim) in a throw-away site dir, checked from a fresh
interpreter that processes that dir's .pth files like site-packages."""

import subprocess
import sys

import pytest

from kvplugins.cli import main as cli_main
from kvplugins.kt_expert_backend import shim
from kvplugins.kt_expert_backend.native import kt_cpu_variant

PROBE = "import site, sys; site.addsitedir(sys.argv[1]); import kt_kernel; print(kt_kernel.KTMoEWrapper.__module__)"


def which_kt(site_dir):
    r = subprocess.run([sys.executable, "-c", PROBE, str(site_dir)], capture_output=True, text=True, timeout=60)
    return r.stdout.strip() if r.returncode == 0 else f"error: {r.stderr.strip().splitlines()[-1]}"


def fake_real_kt(site_dir):
    pkg = site_dir / "kt_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("class KTMoEWrapper:\n    pass\n")


def test_enable_disable_roundtrip(tmp_path, capsys):
    assert which_kt(tmp_path).startswith("error")
    assert cli_main(["kt", "enable", "--site-dir", str(tmp_path)]) == 0
    assert "enabled" in capsys.readouterr().out
    assert which_kt(tmp_path) == "kvplugins.kt_expert_backend.wrapper"
    assert shim.status(tmp_path).enabled
    variant = subprocess.run(
        [
            sys.executable,
            "-c",
            "import site, sys; site.addsitedir(sys.argv[1]); import kt_kernel; print(kt_kernel.__cpu_variant__)",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    # kt-kernel's names for our tiers
    assert variant in ("amx", "avx512_bf16", "avx512_vnni", "avx512_base", "avx2", "scalar")
    assert variant == kt_cpu_variant()  # this CPU's best tier
    assert cli_main(["kt", "disable", "--site-dir", str(tmp_path)]) == 0
    assert which_kt(tmp_path).startswith("error") and not shim.status(tmp_path).enabled
    assert cli_main(["kt", "disable", "--site-dir", str(tmp_path)]) == 0  # idempotent


def test_refuses_to_shadow_a_real_kt_kernel_unless_forced(tmp_path, capsys):
    fake_real_kt(tmp_path)
    assert cli_main(["kt", "enable", "--site-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "real kt-kernel is installed" in err and "--force" in err
    assert which_kt(tmp_path) == "kt_kernel"  # untouched
    assert cli_main(["kt", "enable", "--force", "--site-dir", str(tmp_path)]) == 0
    assert "shadowing" in capsys.readouterr().out
    assert which_kt(tmp_path) == "kvplugins.kt_expert_backend.wrapper"
    assert cli_main(["kt", "disable", "--site-dir", str(tmp_path)]) == 0
    assert which_kt(tmp_path) == "kt_kernel" and (tmp_path / "kt_kernel" / "__init__.py").exists()


def test_status_and_convert_errors(tmp_path, capsys):
    assert cli_main(["kt", "status", "--site-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    from kvplugins.kt_expert_backend import native

    assert "disabled" in out and f"kernels on this CPU: {native.best_isa()} (" in out  # the tier, and why
    assert (
        cli_main(
            [
                "kt",
                "convert",
                "--input",
                str(tmp_path),
                "--output",
                str(tmp_path / "o"),
                "--method",
                "int8",
                "--no-progress",
            ]
        )
        == 2
    )
    assert "config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["kt", "convert", "--input", str(tmp_path), "--output", "o", "--method", "fp8"])
