"""`kvplugins status` prints the pool as a table: one row per segment (host, size, used %, objects, heartbeat,
disk tier), totals and counters, from real processes; --json keeps the machine-readable answer."""

import json
import os
import subprocess

from rich.console import Console

from helpers.cluster import store_cluster
from kvplugins.cli.status import render
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.embedded import CLI


def status(master: str, *flags: str) -> str:
    out = subprocess.run(
        CLI + ["status", "--master", master, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "220"},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def row(text: str, name: str) -> list[str]:
    line = next(line for line in text.splitlines() if name in line)
    return [c.strip() for c in line.replace("┃", "│").split("│") if c.strip()]


def test_table_rows_totals_and_disk_tier(tmp_path):
    with store_cluster(nodes=1, segment_size="4MiB") as c:
        c.add_node("4MiB", disk_dir=tmp_path / "disk", disk_capacity="16MiB")
        plain, disk = (n.address for n in c.nodes)
        with StoreClient(ClientConfig(master=c.master)) as client:
            assert client.batch_put([f"t/{i}" for i in range(8)], [b"s" * 65536] * 8) == [None] * 8
            client.get("t/0")
            assert client.batch_exists(["t/1", "t/none"]) == [True, False]
        text = status(c.master)
        raw = json.loads(status(c.master, "--json"))
    segs = {s["name"]: s for s in raw["segments"]}
    assert set(segs) == {plain, disk} and raw["objects"] == 8
    assert raw["tier_segments"][disk]["disk_capacity"] == 16 << 20
    assert raw["tier_segments"].get(plain, {}).get("disk_capacity", 0) == 0
    header = row(text, "segment")
    assert header == ["segment", "host", "size", "used", "used %", "objects", "heartbeat", "disk tier"]
    for name, seg in segs.items():
        cells = row(text, name)
        assert cells[2] == "4.0 MiB", cells
        assert cells[4] == f"{100 * seg['used'] / seg['size']:.1f}" and cells[5] == str(seg["objects"])
        assert cells[6].endswith("ms")
        assert cells[7] == ("0 obj / 16.0 MiB" if name == disk else "-"), cells
    total = row(text, "total")
    assert total[1:3] == ["2 segments", "8.0 MiB"] and total[5] == "8" and total[-1] == "0 B of 16.0 MiB"
    assert "get hits 1" in text and "get misses 0" in text and "evictions 0" in text
    assert raw["lookup_keys"] >= 2 and raw["lookup_hits"] < raw["lookup_keys"]  # the lookup missed once
    assert f"hit ratio {100 * raw['lookup_hits'] / raw['lookup_keys']:.1f}%" in text


def test_render_without_disk_tier_has_no_disk_column():
    st = {
        "segments": [
            {"name": "a:1", "host_id": "h1", "size": 1000, "used": 250, "objects": 3, "heartbeat_age_ms": 120}
        ],
        "objects": 3,
        "pending": 1,
        "zombies": 0,
        "bytes_used": 250,
        "bytes_total": 1000,
        "hits": 3,
        "misses": 0,
        "lookup_keys": 4,
        "lookup_hits": 3,
        "evictions": 2,
        "corrupt_replicas": 1,
        "tier_segments": {},
    }
    console = Console(record=True, width=160)
    render("m:1", st, console)
    text = console.export_text()
    cells = row(text, "a:1")
    assert cells[:2] == ["a:1", "h1"] and cells[4:] == ["25.0", "3", "120 ms"]
    assert "disk tier" not in text
    assert "hit ratio 75.0%" in text and "checksum errors 1" in text and "pending puts 1" in text


def test_long_segment_names_are_never_cut():
    """A name `kvplugins store --drain --segment` needs shows whole in an 80-column terminal (folded)."""
    name = "vm-20009-ff92c0e1b7d54a3f9e1c2b3a4d5e6f70-host-segment:1"
    st = {
        "segments": [
            {
                "name": name,
                "host_id": "a-long-host-identifier-0123456789abcdef",
                "size": 1 << 30,
                "used": 1 << 20,
                "objects": 3,
                "heartbeat_age_ms": 120,
            }
        ],
        "objects": 3,
        "bytes_used": 1 << 20,
        "bytes_total": 1 << 30,
        "tier_segments": {},
    }
    console = Console(record=True, width=80)
    render("m:1", st, console)
    text = console.export_text()
    assert "…" not in text and name in "".join(
        line.split("│")[1].strip() for line in text.splitlines() if line.count("│") > 2
    )
