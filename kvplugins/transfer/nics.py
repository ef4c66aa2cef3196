"""RDMA NIC discovery for the RDMA transport and ``kvplugins doctor``: which devices and ports this host has,
their state, GID, MTU, NUMA node, PCI address and netdev, and whether RLIMIT_MEMLOCK lets memory be registered.

Sources followed (the same facts ``ibv_devinfo -v`` prints):

* the kernel's sysfs ABI, Documentation/ABI/stable/sysfs-class-infiniband: ``/sys/class/infiniband/<dev>/``
  ``device`` (a link to the PCI function; absent for soft-RoCE ``rxe``, whose parent netdev's device is used),
  ``ports/<p>/{state,lid,link_layer,rate}``, ``ports/<p>/gids/<i>`` (the GID, 8 colon-separated groups of 4 hex
  digits), ``ports/<p>/gid_attrs/types/<i>`` ("RoCE v2", or "IB/RoCE v1"; EINVAL for an unused entry) and
  ``ports/<p>/gid_attrs/ndevs/<i>`` (the netdev a RoCE GID was made from);
* rdma-core's verbs through the native verbs layer (rdma_verbs.query_ports: ibv_open_device + ibv_query_port)
  for the port state, active MTU (an ``ibv_mtu`` enum, 1..5 = 256..4096 bytes), LID and link layer — what
  ``ibv_devinfo`` reports;
* iproute2 (``ip -j -4 addr show``) for the netdev's IPv4 address and prefix length.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import resource
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvplugins.config import format_bytes
from kvplugins.errors import TransferFailed

SYSFS = "/sys"
ROCE_V2, ROCE_V1, IB = "RoCE v2", "RoCE v1", "IB"
ETHERNET, INFINIBAND = "Ethernet", "InfiniBand"
UNLIMITED = -1  # memlock_limit()'s value for RLIM_INFINITY
CAP_IPC_LOCK = 14  # capability bit: lock memory past RLIMIT_MEMLOCK (linux/capability.h)
V4_MAPPED = "0000:0000:0000:0000:0000:ffff:"
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
PCI_ADDRESS = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
# verbs.h enums (rdma-core): ibv_port_state, ibv_mtu, IBV_LINK_LAYER_*; names as the kernel's sysfs "state"
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
LINK_LAYERS = {0: INFINIBAND, 1: INFINIBAND, 2: ETHERNET}  # 0 = unspecified, reported as InfiniBand

FIX_VERBS = "apt-get install libibverbs1 ibverbs-providers libibverbs-dev, then bash ci/install.sh (rebuilds kvplugins)"
FIX_DRIVER = "load the driver (mlx5_ib, or soft-RoCE: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0)"
FIX_NAMES = "set transfer rdma_devices to names listed by `ibv_devices` (or leave it empty for every device)"
FIX_OPEN = (
    "modprobe ib_uverbs and make /dev/infiniband/uverbs* readable and writable (in docker: --device=/dev/infiniband)"
)
FIX_LINK = (
    "bring the link up: `ip link set {netdev} up` and check the cable and switch for RoCE; a running subnet "
    "manager (opensm) for InfiniBand"
)
FIX_ADDRESS = "give the netdev an IP address (ip addr add ADDRESS/PREFIX dev {netdev}): RoCE GIDs are made from it"
MEMLOCK_FIX = (
    "raise it (ulimit -l unlimited, or LimitMEMLOCK=infinity in the systemd unit, or --ulimit memlock=-1 in docker)"
)


@dataclass(frozen=True)
class Nic:
    """One port of one RDMA device. ``gid`` is the chosen GID (index ``gid_index``, type ``gid_type``: "RoCE v2",
    "RoCE v1" or "IB"), "" and index -1 when the port has none. ``active_mtu`` in bytes (256..4096; 0 = unknown,
    only from a sysfs-only discovery), ``speed_gbps`` in Gbit/s (sysfs ``rate``: width x lane speed; rxe
    reports a nominal 2.5), ``ipv4`` "a.b.c.d/prefix" of ``netdev``, ``numa_node`` -1 when unknown, ``pci`` the
    PCI address ("0000:3b:00.0") or None."""

    name: str
    port: int
    state: str
    link_layer: str
    gid_index: int
    gid: str
    gid_type: str
    lid: int
    active_mtu: int
    netdev: str | None
    ipv4: str | None
    numa_node: int
    pci: str | None
    speed_gbps: float | None

    @property
    def usable(self) -> bool:
        """ACTIVE with a GID; on Ethernet a RoCE GID made from an IP address of the netdev, not only the link-local
        default GID every RoCE port has (fe80:, from the MAC), which reaches one Ethernet segment at most."""
        if self.state != "ACTIVE" or not self.gid:
            return False
        return self.link_layer != ETHERNET or (self.gid_type in (ROCE_V2, ROCE_V1) and not _link_local(self.gid))


@dataclass(frozen=True)
class Discovery:
    """What discover() found. ``reason``/``fix``: why no NIC is usable and what to do (None when one is);
    ``notes``: devices left out and why (e.g. one that cannot be opened), while others may still be usable."""

    nics: tuple[Nic, ...]
    reason: str | None
    fix: str | None
    notes: tuple[str, ...] = ()

    @property
    def usable(self) -> tuple[Nic, ...]:
        """The usable NICs, in device then port order."""
        return tuple(n for n in self.nics if n.usable)


def discover(
    devices: Sequence[str] | str | None = None, *, sysfs: str | os.PathLike = SYSFS, verbs: bool = True
) -> Discovery:
    """Every port of the RDMA devices under ``<sysfs>/class/infiniband`` (only those named in ``devices``, a
    sequence or comma list of names; None or empty = all). ``verbs``: also open each device with libibverbs for the
    port attributes (state, active MTU, LID, link layer); False reads sysfs only (active_mtu 0), which is what
    a test over a fake sysfs tree does. Never raises for a missing driver, device or libibverbs: the Discovery says
    why and how to fix it."""
    root = Path(sysfs, "class", "infiniband")
    present = _listdir(root)
    if not present:
        return Discovery((), f"no RDMA device: {root} is {'empty' if root.is_dir() else 'absent'}", FIX_DRIVER)
    wanted = [d.strip() for d in (devices.split(",") if isinstance(devices, str) else devices or ()) if d.strip()]
    names = [n for n in present if n in wanted] if wanted else present
    notes = tuple(f"{d}: no such RDMA device (present: {', '.join(present)})" for d in wanted if d not in present)
    if not names:
        return Discovery((), f"no RDMA device named {', '.join(wanted)} (present: {', '.join(present)})", FIX_NAMES)
    nics = _with_ipv4([nic for name in names for nic in _device_ports(Path(sysfs), name)])
    if verbs:
        from kvplugins.transfer import rdma_verbs

        why = rdma_verbs.load_error()
        if why:
            return Discovery(tuple(nics), why, FIX_VERBS, notes)
        nics, failed = _with_verbs(rdma_verbs.query_ports, nics)
        notes += failed
    return Discovery(tuple(nics), *_why_unusable(nics, notes), notes)


def _why_unusable(nics: list[Nic], notes: tuple[str, ...]) -> tuple[str | None, str | None]:
    if any(n.usable for n in nics):
        return None, None
    if not nics:
        return f"no RDMA port can be used: {'; '.join(notes) or 'the devices have no ports'}", FIX_OPEN
    if not any(n.state == "ACTIVE" for n in nics):
        ports = ", ".join(f"{n.name}/{n.port} {n.state}" for n in nics)
        return f"every RDMA port is down: {ports}", FIX_LINK.format(netdev=_netdevs(nics))
    active = [n for n in nics if n.state == "ACTIVE"]
    where = ", ".join(f"{n.name}/{n.port} (netdev {n.netdev or 'unknown'})" for n in active)
    only = " (only a link-local GID)" if any(_link_local(n.gid) for n in active) else ""
    return (
        f"no RoCE GID from an IP address on {where}: the netdev has no IP address{only}",
        FIX_ADDRESS.format(netdev=_netdevs(active)),
    )


def _netdevs(nics: list[Nic]) -> str:
    return ", ".join(sorted({n.netdev or "NETDEV" for n in nics}))


# -- sysfs ----------------------------------------------------------------------------------------------
def _listdir(path: Path) -> list[str]:
    """Entry names in natural order (mlx5_2 before mlx5_10); [] when ``path`` is absent or unreadable."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(names, key=lambda s: [(int(t), "") if t.isdigit() else (-1, t) for t in re.split(r"(\d+)", s)])


def _read(path: Path) -> str | None:
    """A sysfs attribute's text, stripped; None when absent or refused (EINVAL for an unused GID entry)."""
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _device_ports(sysfs: Path, name: str) -> list[Nic]:
    ports = [p for p in _listdir(sysfs / "class" / "infiniband" / name / "ports") if p.isdigit()]
    return [_port(sysfs, name, int(p)) for p in ports]


def _port(sysfs: Path, name: str, port: int) -> Nic:
    pdir = sysfs / "class" / "infiniband" / name / "ports" / str(port)
    link = _read(pdir / "link_layer") or INFINIBAND
    index, gid, gtype, netdev = choose_gid(pdir, link)
    ddir = sysfs / "class" / "infiniband" / name
    netdev = netdev or _port_netdev(ddir / "device" / "net", port) or _read(ddir / "parent")
    pci, numa = _placement(sysfs, name, netdev)
    state = (_read(pdir / "state") or "UNKNOWN").split(":")[-1].strip()
    lid = _read(pdir / "lid") or "0"
    return Nic(name, port, state, link, index, gid, gtype, int(lid, 16), 0, netdev, None, numa, pci, _rate(pdir))


def choose_gid(port_dir: Path, link_layer: str) -> tuple[int, str, str, str | None]:
    """(index, gid, type, netdev) of the GID to use on the port whose sysfs folder is ``port_dir``: InfiniBand
    index 0; Ethernet the lowest index of the best of: RoCE v2 IPv4-mapped (::ffff:a.b.c.d), RoCE v2 other
    than link-local, RoCE v1 other than link-local, link-local (fe80::/10) RoCE v2, then v1 (a port left with
    these is not usable). (-1, "", type, None) when the port has none."""
    if link_layer != ETHERNET:
        gid = _read(port_dir / "gids" / "0")
        return (0, gid, IB, None) if gid and gid != ZERO_GID else (-1, "", IB, None)
    best: tuple[int, int, str, str] | None = None
    for i in (int(s) for s in _listdir(port_dir / "gid_attrs" / "types") if s.isdigit()):
        text = _read(port_dir / "gid_attrs" / "types" / str(i))
        gid = _read(port_dir / "gids" / str(i)) if text else None
        if gid and gid != ZERO_GID:
            gtype = ROCE_V2 if "v2" in text else ROCE_V1
            cand = (_rank(gid, gtype), i, gid, gtype)
            best = cand if best is None or cand[:2] < best[:2] else best
    if best is None:
        return -1, "", ROCE_V2, None
    netdev = _read(port_dir / "gid_attrs" / "ndevs" / str(best[1]))
    return best[1], best[2], best[3], netdev


def _rank(gid: str, gtype: str) -> int:
    """0 best: RoCE v2 IPv4-mapped, v2 other, v1 from an address, then the link-local ones (v2, v1)."""
    if _link_local(gid):
        return 3 if gtype == ROCE_V2 else 4
    return 2 if gtype != ROCE_V2 else 0 if gid.startswith(V4_MAPPED) else 1


def _link_local(gid: str) -> bool:
    """fe80::/10, the GID of a link-local IPv6 address or the default GID made from the port's MAC."""
    addr = _address(gid)
    return bool(addr and addr.is_link_local)


def _address(gid: str) -> ipaddress.IPv6Address | None:
    """A GID as the IPv6 address it is written as (RoCE GIDs are IPv6 or IPv4-mapped addresses)."""
    try:
        return ipaddress.IPv6Address(gid)
    except ValueError:
        return None


def _port_netdev(net_dir: Path, port: int) -> str | None:
    """The netdev of a port that has no RoCE GID to name it (IPoIB, or RoCE with no address): the one under the
    PCI device whose dev_port (0-based) is port - 1. Soft-RoCE names its netdev in ``parent`` instead."""
    for netdev in _listdir(net_dir):
        if int(_read(net_dir / netdev / "dev_port") or 0) == port - 1:
            return netdev
    return None


def _placement(sysfs: Path, name: str, netdev: str | None) -> tuple[str | None, int]:
    """(PCI address or None, NUMA node or -1) of the device, or of its parent netdev's device (rxe has none)."""
    for link in (sysfs / "class" / "infiniband" / name / "device", sysfs / "class" / "net" / str(netdev) / "device"):
        if link.exists():
            real = link.resolve()
            pci = next((p for p in (real, *real.parents) if PCI_ADDRESS.fullmatch(p.name)), None)
            numa = _read((pci or real) / "numa_node")
            return (pci.name if pci else None), int(numa) if numa and numa.lstrip("-").isdigit() else -1
    return None, -1


def _rate(port_dir: Path) -> float | None:
    """Gbit/s from sysfs ``rate`` ("100 Gb/sec (4X EDR)")."""
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", _read(port_dir / "rate") or "")
    return float(m.group(1)) if m else None


# -- IPv4 (iproute2) ------------------------------------------------------------------------------------
def ipv4_addresses() -> dict[str, list[str]]:
    """netdev -> its IPv4 addresses as "a.b.c.d/prefix", from ``ip -j -4 addr show``; {} where iproute2 is
    missing or fails."""
    try:
        out = subprocess.run(
            ["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
        links = json.loads(out or "[]")
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    return {
        link["ifname"]: [
            f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", ()) if a.get("family") == "inet"
        ]
        for link in links
        if "ifname" in link
    }


def _with_ipv4(nics: list[Nic]) -> list[Nic]:
    """Each NIC with its netdev's IPv4 address: the one its IPv4-mapped GID was made from, else the first."""
    table = ipv4_addresses() if any(n.netdev for n in nics) else {}
    return [dataclasses.replace(n, ipv4=_pick_ipv4(n, table.get(n.netdev or "", []))) for n in nics]


def _pick_ipv4(nic: Nic, addrs: list[str]) -> str | None:
    mapped = _address(nic.gid)
    mapped = mapped and mapped.ipv4_mapped
    if mapped:
        addrs = [a for a in addrs if a.split("/")[0] == str(mapped)] or addrs
    return addrs[0] if addrs else None


# -- verbs ----------------------------------------------------------------------------------------------
def _with_verbs(query_ports, nics: list[Nic]) -> tuple[list[Nic], tuple[str, ...]]:
    """``nics`` with state, active MTU, LID and link layer from query_port; a device that cannot be opened
    is left out and named in the notes."""
    out: list[Nic] = []
    notes: list[str] = []
    for name in dict.fromkeys(n.name for n in nics):
        try:
            ports = [n for n in nics if n.name == name]
            out += [_port_attrs(n, a) for n, a in zip(ports, query_ports(name, [n.port for n in ports]))]
        except TransferFailed as e:  # no uverbs node, permissions
            notes.append(f"{name}: cannot be opened ({e})")
    return out, tuple(notes)


def _port_attrs(nic: Nic, attr: tuple[int, int, int, int]) -> Nic:
    state, mtu, lid, link_layer = attr
    return dataclasses.replace(
        nic,
        state=PORT_STATES.get(state, str(state)),
        lid=int(lid),
        active_mtu=MTU_BYTES.get(mtu, 0),
        link_layer=LINK_LAYERS.get(link_layer, nic.link_layer),
    )


# -- memory locking -------------------------------------------------------------------------------------
def memlock_limit() -> tuple[int, int]:
    """(soft, hard) RLIMIT_MEMLOCK in bytes, UNLIMITED (-1) for RLIM_INFINITY. Registering memory for RDMA
    (ibv_reg_mr) pins it, and pinned bytes count against this limit unless the process has CAP_IPC_LOCK."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    inf = resource.RLIM_INFINITY
    return (UNLIMITED if soft == inf else soft), (UNLIMITED if hard == inf else hard)


def has_ipc_lock(status: str = "/proc/self/status") -> bool:
    """Whether this process may lock memory past RLIMIT_MEMLOCK: bit 14 (CAP_IPC_LOCK) of CapEff in
    ``status`` (proc(5)); where that cannot be read, whether the effective uid is 0."""
    try:
        with open(status) as f:
            caps = next(line.split()[1] for line in f if line.startswith("CapEff:"))
        return bool(int(caps, 16) >> CAP_IPC_LOCK & 1)
    except (OSError, StopIteration, IndexError, ValueError):
        return os.geteuid() == 0


def memlock_problem(
    min_bytes: int, *, limit: tuple[int, int] | None = None, ipc_lock: bool | None = None
) -> str | None:
    """Why RDMA cannot register ``min_bytes`` bytes here, with the fix; None when it can (the soft limit is
    unlimited or at least ``min_bytes``, or the process has CAP_IPC_LOCK, as root normally does). ``limit``
    (soft, hard bytes; -1 unlimited) and ``ipc_lock`` default to this process's (memlock_limit, has_ipc_lock)."""
    soft, hard = memlock_limit() if limit is None else limit
    if soft == UNLIMITED or soft >= min_bytes or (has_ipc_lock() if ipc_lock is None else ipc_lock):
        return None
    hard_text = "" if hard == soft else f" (hard {'unlimited' if hard == UNLIMITED else format_bytes(hard)})"
    return (
        f"RLIMIT_MEMLOCK {format_bytes(soft)}{hard_text} is below the {format_bytes(min_bytes)} to register "
        f"for RDMA: {MEMLOCK_FIX}"
    )
