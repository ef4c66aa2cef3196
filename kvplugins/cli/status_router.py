"""``kvplugins status --router URL``: the fleet a ``kvplugins router`` fronts, as it sees it (its
``/router/status``): one row per instance (role, health and why not, requests in flight, prefill tokens it still
owes, requests routed, blocks its cache holds by the router's view, KV events applied), then what the router
knows of the shared pool and its event feeds; ``--json`` prints the raw answer."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from kvplugins.errors import KVPluginsError


def fetch(url: str, timeout_ms: float) -> dict:
    """The router's /router/status. Raises KVPluginsError naming the URL when it does not answer."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/router/status", timeout=timeout_ms / 1000) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError) as e:
        raise KVPluginsError(f"router {url} did not answer /router/status ({e}); is `kvplugins router` running?") from e


def run_router(url: str, timeout_ms: float, as_json: bool) -> int:
    st = fetch(url, timeout_ms)
    if as_json:
        print(json.dumps(st, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvplugins router @ {url}")
    cols = ("instance", "role", "health", "in flight", "owed tokens", "routed", "cached blocks", "events")
    for col in cols:
        table.add_column(col, justify="left" if col in ("instance", "role", "health") else "right", overflow="fold")
    for i in st["instances"]:
        health = "ok" if i["healthy"] else f"DOWN {i.get('why', '')}"
        table.add_row(
            i["url"], i.get("role", ""), health, str(i["inflight"]), str(i["owed_tokens"]), str(i["routed"]),
            str(i.get("cached_blocks", "")), str(i.get("events", "")),
        )  # fmt: skip
    console = Console()
    console.print(table)
    pool, feeds = st.get("pool", {}), st.get("feeds", {})
    source = "the master's events" if pool.get("pool_exact") else "the connectors' announcements"
    console.print(
        f"pool blocks {pool.get('pool_blocks', 0)} (from {source})  blocks named {pool.get('known_blocks', 0)}  "
        f"event batches {feeds.get('batches', 0)}  bad messages {feeds.get('bad_messages', 0)}"
        + (f"  master events: {feeds['master_error']}" if feeds.get("master_error") else "")
    )
    return 0
