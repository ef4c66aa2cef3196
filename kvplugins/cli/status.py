"""``kvplugins status``: the pool as a table (rich) — one row per segment (host, size, used, objects, heartbeat
age, disk tier), a totals row, then the master's counters; ``--json`` prints the raw ``status`` answer for scripts.
``--router URL``: the fleet a ``kvplugins router`` fronts instead (status_router.py)."""

from __future__ import annotations

import dataclasses
import json

from kvplugins.config import add_arguments, from_args

SHOWN = ("master", "rpc_timeout_ms")
# (label, status key) of the counters shown under the table, when the master reports them.
COUNTERS = (
    ("objects", "objects"),
    ("lookups", "lookup_keys"),
    ("get hits", "hits"),
    ("get misses", "misses"),
    ("puts", "commits"),
    ("removes", "removes"),
    ("evictions", "evictions"),
    ("offloads", "offloads"),
    ("promotions", "promotions"),
    ("checksum errors", "corrupt_replicas"),
    ("segments suspect", "segments_suspect"),
    ("segments refused", "segments_refused"),
    ("segments lost", "segments_lost"),
    ("objects lost", "objects_lost"),
    ("objects restored", "objects_restored"),
    ("replicas to copy again", "repairs_queued"),
    ("re-replications", "repairs_started"),
    ("pending puts", "pending"),
    ("zombie ranges", "zombies"),
)


def add_parser(sub) -> None:
    from kvplugins.store.config import ClientConfig

    p = sub.add_parser("status", help="show the pool: segments, usage, objects, hits/misses, evictions")
    add_arguments(p, ClientConfig, skip=tuple(f.name for f in dataclasses.fields(ClientConfig) if f.name not in SHOWN))
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--router", default="", help="show the fleet a `kvplugins router` at this URL fronts instead")
    p.add_argument("--config", help="TOML/JSON config file ([client] table)")


def run(args) -> int:
    from kvplugins.store import embedded
    from kvplugins.store.config import ClientConfig

    cfg = from_args(ClientConfig, args)
    if args.router:
        from kvplugins.cli.status_router import run_router

        return run_router(args.router, cfg.rpc_timeout_ms, args.json)
    master = embedded.resolve_master(cfg.master)
    if master.startswith("shards://"):
        from kvplugins.cli.status_shards import run_sharded

        return run_sharded(master, cfg.rpc_timeout_ms, args.json)
    st = fetch(master, cfg.rpc_timeout_ms)
    if args.json:
        print(json.dumps(st, indent=1))
    else:
        from rich.console import Console

        render(master, st, Console())
    return 0


def fetch(master: str, timeout_ms: float) -> dict:
    """The master's ``status`` answer. Raises MasterUnreachable."""
    from kvplugins.store.client.connect import control_client

    ctl = control_client(master, timeout_ms)
    try:
        return ctl.call("status")
    finally:
        ctl.close()


def render(master: str, st: dict, console) -> None:
    """Print ``st`` (the ``status`` answer, see fetch) as the segment table and the counters line."""
    console.print(segment_table(master, st))
    console.print(counter_line(st))


def segment_table(master: str, st: dict):
    from rich.table import Table

    from kvplugins.config import format_bytes

    tiers = {
        name: t
        for name, t in (st.get("tier_segments") or {}).items()  # nodes with a disk tier
        if t.get("disk_capacity") or t.get("draining")
    }
    table = Table(title=f"kvplugins store @ {master}", show_footer=True)
    cols = ["segment", "host", "size", "used", "used %", "objects", "heartbeat"] + (["disk tier"] if tiers else [])
    footers = [
        "total",
        f"{len(st['segments'])} segments",
        format_bytes(st["bytes_total"]),
        format_bytes(st["bytes_used"]),
        _pct(st["bytes_used"], st["bytes_total"]),
        str(st["objects"]),
        "",
        _disk_total(st),
    ]
    for col, foot in zip(cols, footers):  # names fold onto more lines, never cut: `--drain --segment` needs them
        table.add_column(
            col,
            foot,
            justify="left" if col in ("segment", "host", "disk tier") else "right",
            overflow="fold" if col in ("segment", "host") else "ellipsis",
        )
    for s in sorted(st["segments"], key=lambda s: s["name"]):
        row = [
            s["name"],
            s.get("host_id", ""),
            format_bytes(s["size"]),
            format_bytes(s["used"]),
            _pct(s["used"], s["size"]),
            str(s["objects"]),
            f"{s['heartbeat_age_ms']} ms" + (" SUSPECT" if s.get("suspect") else ""),
        ]
        table.add_row(*row + ([_disk(tiers.get(s["name"]))] if tiers else []))
    return table


def counter_line(st: dict) -> str:
    """The counters under the table. "hit ratio" is over lookups (exists / exists_prefix keys: what an engine's
    prefix lookup finds); gets are counted apart (an engine gets only what its lookup found)."""
    parts = [f"{label} {st[key]}" for label, key in COUNTERS if isinstance(st.get(key), int)]
    if st.get("lookup_keys"):
        parts.insert(2, f"hit ratio {100 * st.get('lookup_hits', 0) / st['lookup_keys']:.1f}%")
    if st.get("draining"):
        parts.append(f"draining {', '.join(st['draining'])}")
    return "  ".join(parts)


def _pct(used: int, size: int) -> str:
    return f"{100 * used / size:.1f}" if size else "-"


def _disk(tier: dict | None) -> str:
    if not tier:
        return "-"
    from kvplugins.config import format_bytes

    text = f"{tier['disk_objects']} obj / {format_bytes(tier['disk_capacity'])}"
    return text + (" draining" if tier.get("draining") else "")


def _disk_total(st: dict) -> str:
    if not st.get("disk_capacity"):
        return ""
    from kvplugins.config import format_bytes

    return f"{format_bytes(st.get('disk_bytes', 0))} of {format_bytes(st['disk_capacity'])}"
