"""``kvplugins status --master shards://...``: one row per shard (its master address, share of the key space,
objects, segments, bytes used of its DRAM, whether it answered), the membership epoch and whether a move is
still on; ``--json`` prints the membership and every shard's raw ``status``."""

from __future__ import annotations

import json


def fetch(master: str, timeout_ms: float) -> dict:
    """{"membership": ..., "shards": {id: status}, "unreachable": {id: why}}. Raises StoreError when etcd does
    not answer."""
    from kvplugins.errors import StoreError
    from kvplugins.store.client.connect import master_client
    from kvplugins.store.cluster.membership import Membership

    st = Membership(master).read()
    shards, down = {}, {}
    for sid, addr in sorted(st.members.items()):
        rpc = None
        try:
            rpc = master_client(addr, timeout_ms)
            shards[sid] = rpc.call("status")
        except StoreError as e:
            down[sid] = str(e)
        finally:
            if rpc is not None:
                rpc.close()
    return {
        "membership": {
            "epoch": st.epoch,
            "members": st.members,
            "previous": st.previous,
            "joining": {sid: j.address for sid, j in st.joining.items()},
            "moving": st.moving(),
            "swept": st.swept,
            "shares": st.ring.shares(),
        },
        "shards": shards,
        "unreachable": down,
    }


def run_sharded(master: str, timeout_ms: float, as_json: bool) -> int:
    out = fetch(master, timeout_ms)
    if as_json:
        print(json.dumps(out, indent=1))
        return 0
    from rich.console import Console

    Console().print(table(master, out))
    m = out["membership"]
    print(
        f"epoch {m['epoch']}, {len(m['members'])} shards"
        + (f", joining (waiting for extents): {', '.join(sorted(m['joining']))}" if m["joining"] else "")
        + (
            f", a move is on (previous shards: {', '.join(sorted(m['previous'] or {}))})"
            if m["moving"]
            else ", no move in progress"
        )
    )
    return 0


def table(master: str, out: dict):
    from rich.table import Table

    from kvplugins.config import format_bytes

    m = out["membership"]
    t = Table(title=f"kvplugins sharded store @ {master}")
    for col in ("shard", "master", "key share", "objects", "segments", "used", "size", "state"):
        t.add_column(col, justify="left" if col in ("shard", "master", "state") else "right")
    for sid, addr in sorted(m["members"].items()):
        st = out["shards"].get(sid)
        if st is None:
            t.add_row(sid, addr, f"{100 * m['shares'][sid]:.1f}%", "-", "-", "-", "-", "unreachable")
            continue
        t.add_row(
            sid,
            addr,
            f"{100 * m['shares'][sid]:.1f}%",
            str(st["objects"]),
            str(len(st["segments"])),
            format_bytes(st["bytes_used"]),
            format_bytes(st["bytes_total"]),
            "up",
        )
    return t
