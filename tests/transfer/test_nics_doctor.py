"""RDMA NIC discovery (kvplugins/transfer/nics.py) and ``kvplugins doctor`` on this host, which has no RDMA device.

The real-hardware side (rxe devices in a QEMU guest) is tests/rdma/guest; here discovery runs against the real
/sys, against fake sysfs trees written in tmp_path (they stand in for mlx5 and InfiniBand hardware that cannot
exist on this host: the same files and links the kernel's sysfs ABI documents), and doctor runs as a real
``kvplugins`` process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvplugins.transfer import nics, rdma_verbs
from kvplugins.transfer.cma import ptrace_scope

IB_CLASS = Path("/sys/class/infiniband")
HAS_RDMA = IB_CLASS.is_dir() and any(IB_CLASS.iterdir())
no_rdma = pytest.mark.skipif(HAS_RDMA, reason="this host has RDMA devices; these tests describe one without")
GID_V4_LO = "0000:0000:0000:0000:0000:ffff:7f00:0001"  # ::ffff:127.0.0.1, made from "lo"
GID_V4_OTHER = "0000:0000:0000:0000:0000:ffff:0a01:0203"  # ::ffff:10.1.2.3
GID_LINK_LOCAL = "fe80:0000:0000:0000:0e42:a1ff:fe11:2233"
GID_GLOBAL6 = "2001:0db8:0000:0000:0e42:a1ff:fe11:2233"


# -- a fake sysfs tree ----------------------------------------------------------------------------------
def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _pci_function(sysfs: Path, address: str, numa: str) -> Path:
    fn = sysfs / "devices" / f"pci{address[:7]}" / address
    _write(fn / "numa_node", numa)
    return fn


def _device(sysfs: Path, name: str, parent: Path | None) -> Path:
    """class/infiniband/<name> -> the device folder (under the PCI function, or devices/virtual), and its
    ``device`` link to the PCI function when there is one."""
    home = (parent / "infiniband" / name) if parent else sysfs / "devices" / "virtual" / "infiniband" / name
    home.mkdir(parents=True)
    (sysfs / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
    (sysfs / "class" / "infiniband" / name).symlink_to(os.path.relpath(home, sysfs / "class" / "infiniband"))
    if parent:
        (home / "device").symlink_to(os.path.relpath(parent, home))
    return home


def _port(
    home: Path,
    port: int,
    state: str,
    link: str,
    gids: dict[int, tuple[str, str, str]],
    size: int = 8,
    lid: str = "0x0",
    rate: str = "100 Gb/sec (4X EDR)",
) -> None:
    """``gids``: index -> (gid, type text, netdev). Unused entries read as zero GIDs and their types/ndevs entries
    are folders, so reading them fails with an OSError as the kernel's EINVAL does."""
    p = home / "ports" / str(port)
    for name, text in (("state", state), ("link_layer", link), ("lid", lid), ("rate", rate)):
        _write(p / name, text)
    for i in range(size):
        gid, gtype, ndev = gids.get(i, (nics.ZERO_GID, "", ""))
        _write(p / "gids" / str(i), gid)
        for attr, text in (("types", gtype), ("ndevs", ndev)):
            if text:
                _write(p / "gid_attrs" / attr / str(i), text)
            else:
                (p / "gid_attrs" / attr / str(i)).mkdir(parents=True)


def _netdev(sysfs: Path, name: str, device: Path, dev_port: int = 0) -> None:
    _write(device / "net" / name / "dev_port", str(dev_port))
    (sysfs / "class" / "net").mkdir(parents=True, exist_ok=True)
    (sysfs / "class" / "net" / name).symlink_to(os.path.relpath(device / "net" / name, sysfs / "class" / "net"))
    (device / "net" / name / "device").symlink_to("../..")


@pytest.fixture
def fake_sysfs(tmp_path):
    """mlx5_0: RoCE port with every kind of GID; mlx5_1: InfiniBand with IPoIB ib7; rxe0: soft-RoCE over a
    virtio netdev (no PCI link of its own), only a link-local GID."""
    sysfs = tmp_path / "sys"
    eth = _pci_function(sysfs, "0000:3b:00.0", "1")
    _port(
        _device(sysfs, "mlx5_0", eth),
        1,
        "4: ACTIVE",
        "Ethernet",
        {
            0: (GID_LINK_LOCAL, "IB/RoCE v1", "lo"),
            1: (GID_LINK_LOCAL, "RoCE v2", "lo"),
            2: (GID_V4_LO, "IB/RoCE v1", "lo"),
            3: (GID_GLOBAL6, "RoCE v2", "lo"),
            5: (GID_V4_LO, "RoCE v2", "lo"),
        },
    )
    ib = _pci_function(sysfs, "0000:5e:00.0", "0")
    _port(
        _device(sysfs, "mlx5_1", ib),
        1,
        "4: ACTIVE",
        "InfiniBand",
        {0: (GID_LINK_LOCAL, "IB/RoCE v1", "")},
        lid="0x1a",
        rate="200 Gb/sec (4X HDR)",
    )
    _netdev(sysfs, "ib7", ib)
    virtio = _pci_function(sysfs, "0000:00:03.0", "-1") / "virtio0"
    _netdev(sysfs, "kvpfake0", virtio)
    rxe = _device(sysfs, "rxe0", None)
    _write(rxe / "parent", "kvpfake0")
    _port(rxe, 1, "4: ACTIVE", "Ethernet", {0: (GID_LINK_LOCAL, "RoCE v2", "kvpfake0")}, rate="2.5 Gb/sec (1X SDR)")
    return sysfs


# -- discovery on this host and on fake trees -----------------------------------------------------------
@no_rdma
def test_this_host_has_no_rdma_nic_and_discovery_says_why():
    found = nics.discover()
    assert found.nics == () and found.usable == ()
    assert "/sys/class/infiniband" in found.reason or "libibverbs" in found.reason
    assert found.fix in (nics.FIX_DRIVER, nics.FIX_VERBS)


def test_gid_choice_numa_pci_and_netdev_from_sysfs(fake_sysfs):
    found = nics.discover(sysfs=fake_sysfs, verbs=False)
    assert found.reason is None and found.notes == ()
    roce, ib, rxe = found.nics
    # RoCE v2 IPv4-mapped wins over RoCE v1 of the same address, RoCE v2 global IPv6 and link-local ones
    assert (roce.name, roce.port, roce.gid_index, roce.gid, roce.gid_type) == ("mlx5_0", 1, 5, GID_V4_LO, "RoCE v2")
    assert (roce.state, roce.link_layer, roce.netdev, roce.pci, roce.numa_node) == (
        "ACTIVE",
        "Ethernet",
        "lo",
        "0000:3b:00.0",
        1,
    )
    assert roce.speed_gbps == 100.0 and roce.active_mtu == 0 and roce.usable
    if shutil.which("ip"):
        assert roce.ipv4 == "127.0.0.1/8"  # the real "lo", the address its GID was made from
    # InfiniBand: index 0, type IB, the LID in hex, the IPoIB netdev with dev_port 0
    assert (ib.gid_index, ib.gid, ib.gid_type, ib.lid, ib.netdev) == (0, GID_LINK_LOCAL, "IB", 0x1A, "ib7")
    assert (ib.pci, ib.numa_node, ib.speed_gbps, ib.usable) == ("0000:5e:00.0", 0, 200.0, True)
    # soft-RoCE: the netdev from "parent", PCI and NUMA node from the netdev's device (virtio under 0000:00:03.0)
    assert (rxe.gid_index, rxe.gid_type, rxe.netdev, rxe.pci, rxe.numa_node) == (
        0,
        "RoCE v2",
        "kvpfake0",
        "0000:00:03.0",
        -1,
    )
    assert rxe.ipv4 is None and rxe.speed_gbps == 2.5
    assert not rxe.usable  # a link-local GID only: its netdev has no IP address
    assert found.usable == (roce, ib)


def test_gid_rank_without_ipv4_mapped_prefers_global_v2_then_v1_then_link_local(tmp_path):
    port = tmp_path / "dev"
    p = port / "ports" / "1"
    cases = [
        (
            {
                0: (GID_LINK_LOCAL, "IB/RoCE v1", "e0"),
                1: (GID_LINK_LOCAL, "RoCE v2", "e0"),
                2: (GID_GLOBAL6, "RoCE v2", "e1"),
            },
            (2, GID_GLOBAL6, "RoCE v2", "e1"),
        ),
        (
            {0: (GID_V4_OTHER, "IB/RoCE v1", "e0"), 1: (GID_LINK_LOCAL, "RoCE v2", "e0")},
            (0, GID_V4_OTHER, "RoCE v1", "e0"),
        ),
        (
            {0: (GID_LINK_LOCAL, "IB/RoCE v1", "e0"), 2: (GID_V4_OTHER, "IB/RoCE v1", "e1")},
            (2, GID_V4_OTHER, "RoCE v1", "e1"),
        ),
        (
            {0: (GID_LINK_LOCAL, "IB/RoCE v1", "e0"), 1: (GID_LINK_LOCAL, "RoCE v2", "e0")},
            (1, GID_LINK_LOCAL, "RoCE v2", "e0"),
        ),
        ({}, (-1, "", "RoCE v2", None)),
    ]
    for gids, want in cases:
        shutil.rmtree(port, ignore_errors=True)
        _port(port, 1, "4: ACTIVE", "Ethernet", gids)
        assert nics.choose_gid(p, "Ethernet") == want, gids


def test_device_filter_and_its_reasons(fake_sysfs):
    found = nics.discover("mlx5_1, mlx5_9", sysfs=fake_sysfs, verbs=False)
    assert [n.name for n in found.nics] == ["mlx5_1"] and found.reason is None
    assert found.notes == ("mlx5_9: no such RDMA device (present: mlx5_0, mlx5_1, rxe0)",)
    none = nics.discover(["mlx5_9"], sysfs=fake_sysfs, verbs=False)
    assert none.nics == () and none.reason == "no RDMA device named mlx5_9 (present: mlx5_0, mlx5_1, rxe0)"
    assert none.fix == nics.FIX_NAMES
    assert len(nics.discover([], sysfs=fake_sysfs, verbs=False).nics) == 3  # empty = every device


def test_reasons_for_no_device_ports_down_and_no_roce_gid(tmp_path):
    sysfs = tmp_path / "sys"
    assert nics.discover(sysfs=sysfs).reason == f"no RDMA device: {sysfs}/class/infiniband is absent"
    (sysfs / "class" / "infiniband").mkdir(parents=True)
    empty = nics.discover(sysfs=sysfs)
    assert (empty.reason, empty.fix) == (f"no RDMA device: {sysfs}/class/infiniband is empty", nics.FIX_DRIVER)
    rxe = _device(sysfs, "rxe0", None)
    _write(rxe / "parent", "kvpfake0")
    _port(rxe, 1, "1: DOWN", "Ethernet", {0: (GID_LINK_LOCAL, "RoCE v2", "kvpfake0")})
    down = nics.discover(sysfs=sysfs, verbs=False)
    assert (down.reason, down.fix) == ("every RDMA port is down: rxe0/1 DOWN", nics.FIX_LINK.format(netdev="kvpfake0"))
    fix = "give the netdev an IP address (ip addr add ADDRESS/PREFIX dev kvpfake0): RoCE GIDs are made from it"
    for gids, only in (({0: (GID_LINK_LOCAL, "RoCE v2", "kvpfake0")}, " (only a link-local GID)"), ({}, "")):
        shutil.rmtree(rxe / "ports")
        _port(rxe, 1, "4: ACTIVE", "Ethernet", gids)
        bare = nics.discover(sysfs=sysfs, verbs=False)
        assert bare.nics[0].netdev == "kvpfake0" and not bare.nics[0].usable
        assert bare.reason == (
            f"no RoCE GID from an IP address on rxe0/1 (netdev kvpfake0): the netdev has no IP address{only}"
        )
        assert bare.fix == fix


def test_verbs_on_a_fake_tree_names_the_device_it_cannot_open(fake_sysfs):
    """libibverbs (installed on every CI host) finds none of the fake tree's devices, so each is left out and
    named in the notes, with the fix for opening devices."""
    assert rdma_verbs.load_error() is None
    found = nics.discover(sysfs=fake_sysfs)
    assert found.nics == () and [n.split(":")[0] for n in found.notes] == ["mlx5_0", "mlx5_1", "rxe0"]
    assert found.reason.startswith("no RDMA port can be used: mlx5_0: cannot be opened (RDMA device mlx5_0: ")
    assert found.fix == nics.FIX_OPEN


@pytest.mark.skipif(not shutil.which("ip"), reason="iproute2 is not installed")
def test_ipv4_addresses_reads_the_real_loopback():
    assert "127.0.0.1/8" in nics.ipv4_addresses()["lo"]


# -- memlock ---------------------------------------------------------------------------------------------
def test_memlock_problem_message():
    msg = nics.memlock_problem(1 << 30, limit=(8 << 20, 8 << 20), ipc_lock=False)
    assert msg == (
        "RLIMIT_MEMLOCK 8.0 MiB is below the 1.0 GiB to register for RDMA: raise it (ulimit -l "
        "unlimited, or LimitMEMLOCK=infinity in the systemd unit, or --ulimit memlock=-1 in docker)"
    )
    assert "(hard unlimited)" in nics.memlock_problem(1 << 30, limit=(64 << 10, -1), ipc_lock=False)
    assert nics.memlock_problem(1 << 30, limit=(8 << 20, 8 << 20), ipc_lock=True) is None
    assert nics.memlock_problem(1 << 30, limit=(-1, -1), ipc_lock=False) is None
    assert nics.memlock_problem(8 << 20, limit=(8 << 20, 8 << 20), ipc_lock=False) is None


def test_has_ipc_lock_reads_capeff_bit_14(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000004000\n")
    assert nics.has_ipc_lock(str(status))
    status.write_text("Name:\tx\nCapEff:\t000001ffffffbfff\n")
    assert not nics.has_ipc_lock(str(status))


MLOCK_PROBE = """
import ctypes, mmap, sys
from kvplugins.transfer import nics
need = 16 << 20
buf = mmap.mmap(-1, need)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
locked = ctypes.CDLL(None, use_errno=True).mlock(ctypes.c_void_p(addr), ctypes.c_size_t(need)) == 0
print(locked, nics.memlock_limit(), nics.memlock_problem(need))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("prlimit"),
    reason="needs root, setpriv and prlimit to drop CAP_IPC_LOCK",
)
@pytest.mark.parametrize("drop", [True, False])
def test_memlock_problem_agrees_with_the_kernel(drop):
    """Under an 8 MiB RLIMIT_MEMLOCK, locking 16 MiB fails exactly when CAP_IPC_LOCK is dropped, and
    memlock_problem says so exactly then (ibv_reg_mr pins memory against the same limit)."""
    cmd = ["prlimit", "--memlock=8388608:8388608", sys.executable, "-c", MLOCK_PROBE]
    if drop:
        cmd = ["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock"] + cmd
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    locked, rest = out.split(" ", 1)
    assert rest.startswith("(8388608, 8388608) ")
    assert locked == str(not drop)
    problem = rest.split(") ", 1)[1]
    assert problem == (
        "RLIMIT_MEMLOCK 8.0 MiB is below the 16.0 MiB to register for RDMA: " + nics.MEMLOCK_FIX if drop else "None"
    )


# -- kvplugins doctor, a real process -------------------------------------------------------------------
def _kvplugins() -> list[str]:
    """The venv's console script, or the same command through this interpreter."""
    script = Path(sys.executable).with_name("kvplugins")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvplugins.cli"]


def _doctor(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    cmd = _kvplugins()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUGINS_")}
    env.update(COLUMNS="200", **(env_extra or {}))
    return subprocess.run(cmd + ["doctor", *args], capture_output=True, text=True, timeout=120, env=env, check=False)


@no_rdma
def test_doctor_names_the_missing_rdma_and_the_working_shm_cma_and_tcp():
    text, js = _doctor(), _doctor("--json")
    assert text.returncode == 0 and js.returncode == 0, text.stderr + js.stderr
    report = json.loads(js.stdout)
    rdma = report["rdma"]
    assert not rdma["available"] and rdma["nics"] == []
    assert rdma["problems"][0]["reason"].startswith(("no RDMA device: /sys/class/infiniband is ", "libibverbs"))
    for p in rdma["problems"]:
        assert f"rdma: {p['reason']}" in text.stdout and f"  fix: {p['fix']}" in text.stdout
    assert report["shm"]["available"] and report["shm"]["memfd"] and report["shm"]["dev_shm_free"] > 0
    assert report["tcp"] == {
        "available": True,
        "problems": [],
        "host": "127.0.0.1",
        "port": 0,
        "binds": True,
        "configured": True,
    }
    scope = ptrace_scope()  # Yama decides whether cma reaches same-user peers: 0 or absent here
    assert report["cma"]["ptrace_scope"] == scope and report["cma"]["available"] == (scope in (None, 0))
    assert f"Yama ptrace_scope {'absent (same user)' if scope is None else scope}" in text.stdout
    want = ["shm", "cma", "tcp"] if scope in (None, 0) else ["shm", "tcp"]
    assert report["available"] == want
    assert f"available: {', '.join(want)}" in text.stdout
    assert "backend memfd; memfd works; /dev/shm" in text.stdout and "127.0.0.1:0 binds" in text.stdout


def test_doctor_exits_1_when_the_tcp_port_is_taken():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        res = _doctor("--tcp-port", str(port))
        js = json.loads(_doctor("--json", env_extra={"KVPLUGINS_TRANSFER_TCP_PORT": str(port)}).stdout)
    assert res.returncode == 1
    reason = f"cannot bind 127.0.0.1:{port} (Address already in use)"
    assert f"tcp: {reason}" in res.stdout and "set the transfer host to an address of this machine" in res.stdout
    assert js["tcp"]["problems"][0]["reason"] == reason and not js["tcp"]["available"]
    assert "tcp" not in js["available"]


def test_doctor_reports_a_memlock_shortfall_with_its_fix(tmp_path):
    if os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("prlimit"):
        pytest.skip("needs root, setpriv and prlimit to drop CAP_IPC_LOCK")
    cmd = [
        "setpriv",
        "--bounding-set=-ipc_lock",
        "--inh-caps=-ipc_lock",
        "prlimit",
        "--memlock=8388608:8388608",
        *_kvplugins(),
        "doctor",
        "--json",
        "--memlock-need",
        "1GiB",
    ]
    report = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout)
    want = {"reason": "RLIMIT_MEMLOCK 8.0 MiB is below the 1.0 GiB to register for RDMA", "fix": nics.MEMLOCK_FIX}
    assert want in report["rdma"]["problems"]
    assert report["rdma"]["memlock"] == {"soft": 8 << 20, "hard": 8 << 20, "need": 1 << 30, "cap_ipc_lock": False}


def test_docs_quote_every_fix_verbatim():
    """docs/transfer.md's table of reasons and fixes stays true to the code."""
    from kvplugins.cli import doctor

    text = (Path(__file__).parents[2] / "docs" / "transfer.md").read_text()
    fixes = [
        nics.FIX_DRIVER,
        nics.FIX_NAMES,
        nics.FIX_VERBS,
        nics.FIX_OPEN,
        nics.FIX_LINK,
        nics.FIX_ADDRESS,
        nics.MEMLOCK_FIX,
        doctor.FIX_SHM,
        doctor.FIX_BIND,
    ]
    for fix in fixes:
        assert fix.format(netdev="<netdev>") in text, fix
