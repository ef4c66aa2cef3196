"""``kvplugins status``: segments, bytes used/total, objects, hits/misses, evictions of a master."""
from __future__ import annotations

import dataclasses

from kvplugins.config import add_arguments, from_args

SHOWN = ("master", "rpc_timeout_ms")


def add_parser(sub) -> None:
    from kvplugins.store.config import ClientConfig
    p = sub.add_parser("status", help="show the pool: segments, usage, objects, hits/misses, evictions")
    add_arguments(p, ClientConfig, skip=tuple(f.name for f in dataclasses.fields(ClientConfig)
                                             if f.name not in SHOWN))
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--config", help="TOML/JSON config file ([client] table)")


def run(args) -> int:
    import json

    from kvplugins.store import embedded
    from kvplugins.store.config import ClientConfig
    from kvplugins.store.rpc_client import control_client
    cfg = from_args(ClientConfig, args)
    master = embedded.resolve_master(cfg.master)
    ctl = control_client(master, cfg.rpc_timeout_ms)
    try:
        st = ctl.call("status")
    finally:
        ctl.close()
    if args.json:
        print(json.dumps(st, indent=1))
    else:
        _render(master, st)
    return 0


def _render(master: str, st: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvplugins.config import format_bytes
    table = Table(title=f"kvplugins store @ {master}")
    for col in ("segment", "host", "used", "total", "use %", "objects", "free blocks", "heartbeat age"):
        table.add_column(col, justify="left" if col in ("segment", "host") else "right")
    for s in st["segments"]:
        table.add_row(s["name"], s["host_id"], format_bytes(s["used"]), format_bytes(s["size"]),
                      f"{100 * s['used'] / s['size']:.1f}", str(s["objects"]), str(s["free_blocks"]),
                      f"{s['heartbeat_age_ms']} ms")
    console = Console()
    console.print(table)
    console.print(f"objects {st['objects']} (pending {st['pending']})  used {format_bytes(st['bytes_used'])} / "
                  f"{format_bytes(st['bytes_total'])}  hits {st['hits']}  misses {st['misses']}  "
                  f"evictions {st['evictions']}  lost segments {st['segments_lost']}")
