"""Runs the RDMA suite on real verbs: boots the soft-RoCE QEMU guest (ci/rxe-guest.sh, two NICs: rxe0 on eth0,
rxe1 on eth1) and runs there tests/rdma/guest (striping, failover, QP rebuild, auth, store over RDMA, doctor)
and the transfer contract suite over rdma (tcp and shm run it on the host, tests/transfer), and the P2P store's
tests with its pulls over rdma. The guest's output
is printed, so a failure reads as the guest's pytest report. Skipped, saying why and the fix, where QEMU or Debian's kernel is not installed."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "ci" / "rxe-guest.sh"
GUEST_TESTS = ["tests/rdma/guest", "tests/transfer/test_contract.py", "tests/p2p/test_p2p_store.py"]


def _missing() -> str | None:
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed"
    if not any(p.name.endswith("-amd64") for p in Path("/lib/modules").glob("*")):
        return "Debian's kernel (linux-image-amd64) is not installed"
    return None


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rdma_suite_in_soft_roce_guest():
    why = _missing()
    if why:
        pytest.skip(f"no soft-RoCE guest: {why}; fix: bash ci/install.sh")
    env = {  # tcp and shm: the host runs their contract suite; the P2P store pulls over rdma (tcp to set QPs up)
        **os.environ,
        "KVPLUGINS_TEST_TRANSPORTS": "rdma",
        "KVPLUGINS_TEST_P2P_TRANSPORTS": "rdma,tcp",
    }
    cmd = [
        "bash",
        str(RUNNER),
        "--nics",
        "2",
        "--timeout",
        "1500",
        "--",
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-ra",
        "-p",
        "no:cacheprovider",
        "--durations=8",
        *GUEST_TESTS,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    out = res.stdout + res.stderr
    print(out)
    summary = [line for line in out.splitlines() if " passed" in line or " failed" in line]
    assert res.returncode == 0, f"guest exit {res.returncode}:\n{out[-6000:]}"
    assert summary and " passed" in summary[-1] and "failed" not in summary[-1] and "error" not in summary[-1], summary
