"""Percentiles, ratios ours/Mooncake, the issue #2 and #13 targets, and the markdown tables printed and written to
docs.

Ratio = ours / Mooncake throughput of the same case and op = Mooncake's p50 batch time / ours (> 1: ours faster).
A "floor" target compares ours with a baseline row of the same run (storebench/baselines.py): ours throughput /
the baseline's, e.g. 0.7 = 70% of memcpy.
"""

from __future__ import annotations

import numpy as np

MC = "mooncake-tcp"
OURS = ("kvp-shm", "kvp-tcp")
BASELINES = ("memcpy", "c-tcp-loopback")
# (name, our target, case, kind, threshold): kind "speedup" needs ratio >= threshold; "latency" needs
# ours p50 / Mooncake p50 <= threshold; "floor:<baseline>" needs ours / the baseline's throughput >= threshold.
# Each is checked for put and get.
TARGETS = (
    ("TCP >= 80% of a C loopback TCP connection, 1MiB x 32", "kvp-tcp", "1MiBx32", "floor:c-tcp-loopback", 0.8),
    ("shm >= 70% of memcpy, 1MiB x 32", "kvp-shm", "1MiBx32", "floor:memcpy", 0.7),
    ("TCP >= 2x Mooncake TCP, 1MiB x 32", "kvp-tcp", "1MiBx32", "speedup", 2.0),
    ("shm >= 5x Mooncake TCP, 1MiB x 32", "kvp-shm", "1MiBx32", "speedup", 5.0),
    ("single 4KiB op p50 <= 0.5x Mooncake (shm)", "kvp-shm", "4KiBx1", "latency", 0.5),
    ("single 4KiB op p50 <= 0.5x Mooncake (tcp)", "kvp-tcp", "4KiBx1", "latency", 0.5),
    ("128 x 4KiB batch >= 10x Mooncake (shm)", "kvp-shm", "4KiBx128", "speedup", 10.0),
    ("128 x 4KiB batch >= 10x Mooncake (tcp)", "kvp-tcp", "4KiBx128", "speedup", 10.0),
)


def summarize(seconds: list[float], batch: int, batch_bytes: int) -> dict:
    """Per batch and per op (batch time / batch) p50/p99/mean in µs, and GB/s (1e9 B/s) at the p50."""
    us = np.asarray(seconds) * 1e6
    p50, p99 = float(np.percentile(us, 50)), float(np.percentile(us, 99))
    return {
        "batch_us": {"p50": p50, "p99": p99, "mean": float(us.mean()), "min": float(us.min())},
        "op_us": {"p50": p50 / batch, "p99": p99 / batch},
        "gbps": batch_bytes / (p50 * 1e-6) / 1e9,
        "ops_per_s": batch / (p50 * 1e-6),
    }


def _index(rows: list[dict]) -> dict:
    return {(r["target"], r["case"], r["op"]): r for r in rows if not r["skipped"]}


def ratios(rows: list[dict]) -> list[dict]:
    """ours/Mooncake throughput ratio per case, op and our mode (only where both ran)."""
    idx, out = _index(rows), []
    for (label, case, op), r in idx.items():
        mc = idx.get((MC, case, op))
        if label in OURS and mc:
            out.append({"target": label, "case": case, "op": op, "ratio": mc["batch_us"]["p50"] / r["batch_us"]["p50"]})
    return out


def targets(rows: list[dict]) -> list[dict]:
    """Each issue #2 target for put and get: value, threshold, met, and the margin (value/threshold)."""
    idx, out = _index(rows), []
    for name, label, case, kind, thr in TARGETS:
        for op in ("put", "get"):
            anchor = kind.split(":")[1] if kind.startswith("floor:") else MC
            ours, mc = idx.get((label, case, op)), idx.get((anchor, case, op))
            item = {"target": name, "op": op, "kind": kind, "threshold": thr, "value": None, "met": None}
            if ours and mc:
                lat = ours["batch_us"]["p50"] / mc["batch_us"]["p50"]
                item["value"] = lat if kind == "latency" else 1 / lat
                item["met"] = item["value"] <= thr if kind == "latency" else item["value"] >= thr
            out.append(item)
    return out


def _verdict(t: dict) -> str:
    if t["value"] is None:
        return "n/a (this case or Mooncake not in the run)"
    v, thr = t["value"], t["threshold"]
    if t["kind"].startswith("floor:"):
        base = t["kind"].split(":")[1]
        word, margin = ("met", v / thr) if t["met"] else ("MISSED", thr / v)
        return f"{word}: {v:.0%} of {base} (needs >= {thr:.0%}; {margin:.2f}x {'above' if t['met'] else 'short'})"
    if t["kind"] == "latency":
        word, margin = ("met", thr / v) if t["met"] else ("MISSED", v / thr)
        how = "better" if t["met"] else "too slow"
        return f"{word}: {v:.2f}x Mooncake's latency (needs <= {thr:g}x; {margin:.2f}x {how})"
    word, margin = ("met", v / thr) if t["met"] else ("MISSED", thr / v)
    return f"{word}: {v:.2f}x (needs >= {thr:g}x; {margin:.2f}x {'above' if t['met'] else 'short'})"


def _fmt_us(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def tables(rows: list[dict]) -> str:
    """Markdown: latency table, throughput + ratio table, targets table."""
    labels = [l for l in (*OURS, MC, *BASELINES) if any(r["target"] == l for r in rows)]
    idx = _index(rows)
    keys = list(dict.fromkeys((r["case"], r["op"]) for r in rows))
    skipped = {(r["case"], r["op"]): r["skipped"] for r in rows if r["skipped"]}
    lat = [
        "| case | op | " + " | ".join(f"{l} µs per batch p50 / p99 (per op p50 / p99)" for l in labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    compared = [l for l in OURS if l in labels and MC in labels]
    thr = [
        "| case | op | " + " | ".join([f"{l} GB/s" for l in labels] + [f"{l}/mooncake" for l in compared]) + " |",
        "|---|---|" + "---|" * (len(labels) + len(compared)),
    ]
    for case, op in keys:
        cells, gb = [], []
        for l in labels:
            r = idx.get((l, case, op))
            cells.append(
                f"{_fmt_us(r['batch_us']['p50'])} / {_fmt_us(r['batch_us']['p99'])} "
                f"({_fmt_us(r['op_us']['p50'])} / {_fmt_us(r['op_us']['p99'])})"
                if r
                else "skipped"
            )
            gb.append(f"{r['gbps']:.3f}" if r else "skipped")
        rat = [_ratio_cell(idx, l, case, op) for l in compared]
        lat.append(f"| {case} | {op} | " + " | ".join(cells) + " |")
        thr.append(f"| {case} | {op} | " + " | ".join(gb + rat) + " |")
    tgt = ["| target | op | result |", "|---|---|---|"]
    tgt += [f"| {t['target']} | {t['op']} | {_verdict(t)} |" for t in targets(rows)]
    notes = [f"- {c} {o}: {why}" for (c, o), why in skipped.items() if o == "put"]
    return "\n".join(
        [
            "### Latency",
            *lat,
            "",
            "### Throughput (GB/s at p50) and ratio ours/Mooncake (>1: ours faster)",
            *thr,
            "",
            "### Targets (issues #2, #13)",
            *tgt,
            *(["", "Skipped:", *notes] if notes else []),
        ]
    )


def _ratio_cell(idx: dict, label: str, case: str, op: str) -> str:
    ours, mc = idx.get((label, case, op)), idx.get((MC, case, op))
    return f"{mc['batch_us']['p50'] / ours['batch_us']['p50']:.2f}x" if ours and mc else "-"
