"""``kvplugins doctor``: the transports this host can use, and for each one missing, why and the fix.

* rdma: every RDMA device port (kvplugins/transfer/nics.py: state, GID index and type, link layer, active MTU,
  NUMA node, PCI address, netdev and IPv4, speed) and RLIMIT_MEMLOCK against ``--memlock-need``;
* shm: whether memfd_create works, the free bytes of /dev/shm, and an allocation with the configured shm_backend;
* tcp: the transfer host and port (TransferConfig: flag > env > file) and whether they bind, and whether a
  non-loopback host has the shared secret it needs.

A table (rich) by default, the same facts as JSON with ``--json``. Exit status 0 when at least TCP works, else 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket

from kvplugins.config import add_arguments, format_bytes, from_args, parse_bytes
from kvplugins.errors import ConfigError

SHOWN = ("host", "tcp_port", "transports", "shm_backend", "rdma_devices")
MEMLOCK_NEED = "1GiB"
TRANSPORTS = ("shm", "cma", "rdma", "tcp")
FIX_CMA = (
    "allow process_vm_readv/process_vm_writev in the container's seccomp profile (docker: its default "
    "profile allows them with CAP_SYS_PTRACE: --cap-add SYS_PTRACE)"
)
FIX_PTRACE = "sysctl kernel.yama.ptrace_scope=0, or give the engine processes CAP_SYS_PTRACE"
FIX_SHM = "mount a tmpfs on /dev/shm (docker: --shm-size=8g or --ipc=host), or set transfer shm_backend=memfd"
FIX_BIND = (
    "set the transfer host to an address of this machine (--host, KVPLUGINS_TRANSFER_HOST) and tcp_port "
    "to a free port (0 = any)"
)


def add_parser(sub) -> None:
    from kvplugins.transfer.config import TransferConfig

    p = sub.add_parser(
        "doctor", help="check this host's transports (shm, cma, RDMA, TCP): what works, why not, the fix"
    )
    add_arguments(
        p, TransferConfig, skip=tuple(f.name for f in dataclasses.fields(TransferConfig) if f.name not in SHOWN)
    )
    p.add_argument(
        "--memlock-need",
        default=MEMLOCK_NEED,
        help=f"bytes one process will register for RDMA, checked against RLIMIT_MEMLOCK (default: {MEMLOCK_NEED})",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--config", help="TOML/JSON config file ([transfer] table)")


def run(args) -> int:
    from kvplugins.transfer.config import TransferConfig

    report = gather(from_args(TransferConfig, args), parse_bytes(args.memlock_need))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        from rich.console import Console

        render(report, Console(soft_wrap=True))
    return 0 if report["tcp"]["available"] else 1


def gather(cfg, memlock_need: int) -> dict:
    """The report: {"transports": configured names, "available": usable names, "shm"|"cma"|"rdma"|"tcp": {"available",
    "configured", "problems": [{"reason", "fix"}], details...}}. Sizes in bytes."""
    out = {
        "transports": cfg.transport_list(),
        "rdma": rdma_check(getattr(cfg, "rdma_devices", ""), memlock_need),
        "shm": shm_check(cfg.shm_backend),
        "cma": cma_check(),
        "tcp": tcp_check(cfg.host, cfg.tcp_port),
    }
    for name in TRANSPORTS:
        out[name]["configured"] = name in out["transports"]
    out["available"] = [name for name in TRANSPORTS if out[name]["available"]]
    return out


def _problem(reason: str, fix: str | None) -> dict:
    return {"reason": reason, "fix": fix}


def rdma_check(devices: str, memlock_need: int) -> dict:
    """discover() plus RLIMIT_MEMLOCK (soft, hard: bytes, -1 unlimited) and CAP_IPC_LOCK."""
    from kvplugins.transfer import nics

    found = nics.discover(devices or None)
    soft, hard = nics.memlock_limit()
    lock = nics.has_ipc_lock()
    problems = [] if found.reason is None else [_problem(found.reason, found.fix)]
    short = nics.memlock_problem(memlock_need, limit=(soft, hard), ipc_lock=lock)
    if short:
        problems.append(_problem(short.removesuffix(f": {nics.MEMLOCK_FIX}"), nics.MEMLOCK_FIX))
    return {
        "available": not problems,
        "problems": problems,
        "notes": list(found.notes),
        "nics": [dict(dataclasses.asdict(n), usable=n.usable) for n in found.nics],
        "memlock": {"soft": soft, "hard": hard, "need": memlock_need, "cap_ipc_lock": lock},
    }


def shm_check(backend: str) -> dict:
    """memfd_create works?, /dev/shm free bytes (None if absent), one page allocated with ``backend``."""
    from kvplugins.transfer import shmem

    memfd_error = None
    try:
        os.close(os.memfd_create("kvp-doctor", 0))
    except (OSError, AttributeError) as e:
        memfd_error = str(e)
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    problems = []
    try:
        shmem.allocate(4096, backend).close()
    except OSError as e:
        problems.append(_problem(f"cannot allocate shared memory with shm_backend={backend} ({e})", FIX_SHM))
    return {
        "available": not problems,
        "problems": problems,
        "backend": backend,
        "memfd": memfd_error is None,
        "memfd_error": memfd_error,
        "dev_shm_free": free,
    }


def cma_check() -> dict:
    """Whether cross-memory attach works here (a copy out of this process's own memory) and Yama's ptrace_scope
    (None: no Yama), which decides whose memory it reaches: at 0 every process of the same user."""
    from kvplugins.transfer import cma

    scope, why = cma.ptrace_scope(), cma.self_check()
    problems = [] if why is None else [_problem(why, FIX_CMA)]
    if why is None and scope not in (None, 0):
        problems.append(
            _problem(
                f"kernel.yama.ptrace_scope is {scope}: process_vm_readv reaches "
                f"{'only descendants' if scope == 1 else 'no other process'}, so same-host peers "
                "fall back to the next transport (tcp)",
                FIX_PTRACE,
            )
        )
    return {"available": not problems, "problems": problems, "ptrace_scope": scope}


def tcp_check(host: str, port: int) -> dict:
    """Whether the transfer TCP server could start: the shared-secret rule for its host, and a bind."""
    from kvplugins.security import load_secret, require_for_bind

    problems, binds = [], True
    try:
        require_for_bind(host, load_secret(), "transfer host (--host, KVPLUGINS_TRANSFER_HOST)")
    except ConfigError as e:
        problems.append(_problem(str(e), None))
    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        binds = False
        problems.append(_problem(f"cannot bind {host}:{port} ({os.strerror(e.errno) if e.errno else e})", FIX_BIND))
    return {"available": not problems, "problems": problems, "host": host, "port": port, "binds": binds}


# -- rendering ------------------------------------------------------------------------------------------
NIC_COLUMNS = ("device", "port", "state", "GID (index, type)", "link", "MTU", "NUMA", "PCI", "netdev / IPv4", "speed")


def render(report: dict, console) -> None:
    """Print ``report`` (see gather): the NIC table, the transport table, then every problem with its fix."""
    from rich.text import Text

    if report["rdma"]["nics"]:
        console.print(nic_table(report["rdma"]["nics"]))
    console.print(transport_table(report))
    for name in ("rdma", "shm", "tcp"):
        for p in report[name]["problems"]:
            console.print(Text(f"{name}: {p['reason']}"))
            if p["fix"]:
                console.print(Text(f"  fix: {p['fix']}"))
        for note in report[name].get("notes", ()):
            console.print(Text(f"{name} note: {note}"))
    console.print(Text(f"available: {', '.join(report['available']) or 'none'}"))


def nic_table(rows: list[dict]):
    from rich.table import Table

    table = Table(title="RDMA devices")
    for col in NIC_COLUMNS:
        table.add_column(col)
    for n in rows:
        gid = f"{n['gid']} ({n['gid_index']}, {n['gid_type']})" if n["gid"] else "none"
        speed = f"{n['speed_gbps']:g} Gb/s" if n["speed_gbps"] is not None else "-"
        table.add_row(
            n["name"],
            str(n["port"]),
            n["state"],
            gid,
            n["link_layer"],
            str(n["active_mtu"] or "-"),
            str(n["numa_node"]),
            n["pci"] or "-",
            f"{n['netdev'] or '-'} / {n['ipv4'] or '-'}",
            speed,
        )
    return table


def transport_table(report: dict):
    from rich.table import Table

    table = Table(title="transports on this host")
    for col in ("transport", "configured", "available", "details"):
        table.add_column(col)
    for name in TRANSPORTS:
        r = report[name]
        table.add_row(name, "yes" if r["configured"] else "no", "yes" if r["available"] else "NO", _details(name, r))
    return table


def _details(name: str, r: dict) -> str:
    if name == "rdma":
        m = r["memlock"]
        usable = sum(n["usable"] for n in r["nics"])
        return (
            f"{usable} usable port(s) of {len(r['nics'])}; RLIMIT_MEMLOCK {_limit(m['soft'])} (hard "
            f"{_limit(m['hard'])}), CAP_IPC_LOCK {'yes' if m['cap_ipc_lock'] else 'no'}"
        )
    if name == "shm":
        free = "absent" if r["dev_shm_free"] is None else f"{format_bytes(r['dev_shm_free'])} free"
        return f"backend {r['backend']}; memfd {'works' if r['memfd'] else 'refused'}; /dev/shm {free}"
    if name == "cma":
        scope = "absent (same user)" if r["ptrace_scope"] is None else r["ptrace_scope"]
        return f"process_vm_readv; Yama ptrace_scope {scope}"
    return f"{r['host']}:{r['port']} {'binds' if r['binds'] else 'does not bind'}"


def _limit(n: int) -> str:
    return "unlimited" if n < 0 else format_bytes(n)
