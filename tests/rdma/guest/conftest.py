"""Tests in this folder need real RDMA devices: they run only inside the soft-RoCE guest (ci/rxe-guest.sh sets
KVPLUGINS_IN_GUEST=1), started by tests/rdma/test_guest.py. On any other host they are not collected at all.

Fixtures: ``rxe_devices`` (the RDMA device names the kernel lists in sysfs, e.g. ["rxe0", "rxe1"]); ``nic_link`` (sets
``ip link set ethN down|up``; every link it touched is up again after the test); ``roce_v2_gid`` (a function:
a device's IPv4-mapped RoCE v2 GID index on port 1, read from sysfs, which is perftest's ``-x``)."""

import os
import subprocess
from pathlib import Path

import pytest

collect_ignore_glob = [] if os.environ.get("KVPLUGINS_IN_GUEST") == "1" else ["test_*.py"]


@pytest.fixture(scope="session")
def rxe_devices() -> list[str]:
    return sorted(os.listdir("/sys/class/infiniband"))


@pytest.fixture
def nic_link():
    touched: set[str] = set()

    def set_link(netdev: str, state: str) -> None:
        touched.add(netdev)
        subprocess.run(["ip", "link", "set", netdev, state], check=True)

    yield set_link
    for netdev in sorted(touched):
        subprocess.run(["ip", "link", "set", netdev, "up"], check=False)


@pytest.fixture(scope="session")
def roce_v2_gid():
    return _roce_v2_gid


def _roce_v2_gid(device: str, port: int = 1) -> int:
    """The index of the port's RoCE v2 GID that carries an IPv4 address (::ffff:a.b.c.d)."""
    base = Path(f"/sys/class/infiniband/{device}/ports/{port}")
    for t in sorted(base.glob("gid_attrs/types/*"), key=lambda p: int(p.name)):
        try:
            kind, gid = t.read_text().strip(), (base / "gids" / t.name).read_text().strip()
        except OSError:  # an unset GID table entry reads EINVAL
            continue
        if kind == "RoCE v2" and gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            return int(t.name)
    raise LookupError(f"{device} port {port} has no IPv4-mapped RoCE v2 GID")
