"""Results of ``kvplugins replay``: a table, JSON, and the hit-ratio-vs-capacity plot (matplotlib, the plot extra)."""

from __future__ import annotations

import io
import json
import shutil
import statistics

from kvplugins.config import format_bytes
from kvplugins.errors import ConfigError


def row(res, block_bytes: int, reference: float | None, prefill_tok_s: float) -> dict:
    """One result as a flat dict: capacities in blocks and full-scale bytes, hit ratios, tokens saved, the
    estimated prefill GPU seconds saved (tokens saved / ``prefill_tok_s``), store ops/s and latency
    percentiles (ms)."""
    p = res.plan
    out = {
        "config": p.label,
        "instances": p.instances,
        "routing": p.routing,
        "pool_blocks": p.pool_blocks,
        "pool_bytes": p.pool_blocks * block_bytes,
        "local_blocks_per_instance": p.local_blocks,
        "local_bytes_per_instance": p.local_blocks * block_bytes,
        "requests": res.requests,
        "blocks": res.blocks,
        "hit_ratio": round(res.hit_ratio, 4),
        "local_hit_ratio": round(res.local_hits / res.blocks, 4) if res.blocks else 0.0,
        "pool_hit_ratio": round(res.pool_hits / res.blocks, 4) if res.blocks else 0.0,
        "reference_lru_hit_ratio": None if reference is None else round(reference, 4),
        "tokens": res.tokens,
        "prefill_tokens_saved": res.tokens_saved,
        "prefill_gpu_s_saved": round(res.tokens_saved / prefill_tok_s, 1) if prefill_tok_s else None,
        "seconds": round(res.seconds, 2),
        "puts": res.puts,
        "put_failures": res.put_failures,
        "gets": res.gets,
        "get_misses": res.get_misses,
        "wrong_bytes": res.wrong_bytes,
        "store_errors": res.store_errors,
        "puts_per_s": round(res.puts / res.seconds) if res.seconds else 0,
        "gets_per_s": round(res.gets / res.seconds) if res.seconds else 0,
    }
    if p.prefill_tok_s:
        out.update(_ttft(res))
    if p.speed:
        out["speed"], out["max_lag_ms"] = p.speed, round(res.max_lag_ms, 1)
        for op, ms in res.latency.items():
            out[f"{op}_ms"] = _percentiles(ms)
    return out


def _ttft(res) -> dict:
    """The TTFT model's figures: TTFT percentiles (ms) of the served requests, rejections, and against the SLO:
    attainment of the served ones, the share of all requests served within it, goodput (those per simulated s)."""
    p, served = res.plan, len(res.ttft_ms)
    out = {"ttft_ms": _percentiles(res.ttft_ms), "rejected": res.rejected, "clock": p.clock}
    if p.slo_ms:
        out["slo_ttft_ms"] = p.slo_ms
        out["slo_attainment"] = round(res.slo_met / served, 4) if served else 0.0
        out["within_slo"] = round(res.slo_met / (served + res.rejected), 4) if served + res.rejected else 0.0
        out["goodput_rps"] = round(res.slo_met / res.span_s, 3) if res.span_s else 0.0
    return out


def _percentiles(ms: list[float]) -> dict:
    if not ms:
        return {}
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else [ms[0]] * 99
    return {"p50": round(q[49], 3), "p90": round(q[89], 3), "p99": round(q[98], 3), "n": len(ms)}


def table(rows: list[dict], width: int | None = None) -> str:
    """The rows as two rich tables, rendered to text (what the CLI prints): the hit ratios per configuration,
    then what the hits saved and what the store did; latency percentiles below, for timed runs. ``width``:
    columns (None: the terminal's, at least 80)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    hits = Table(title="hit ratio (of the trace's blocks)", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    work = Table(
        title="what the hits saved, what the store did", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False
    )
    for t, heads in (
        (hits, ("pool", "local/inst", "hit", "local", "pool", "ref LRU")),
        (work, ("pool", "tokens\nsaved", "GPU s\nsaved", "puts/s", "gets/s", "failed\nputs", "wrong\nbytes")),
    ):
        t.add_column("config", ratio=1, overflow="fold")  # the one column that wraps; numbers never do
        for h in heads:
            t.add_column(h, justify="right", no_wrap=True)
    tails = []
    for r in rows:
        pool = f"{r['pool_blocks']} ({format_bytes(r['pool_bytes'])})"
        ref = r["reference_lru_hit_ratio"]
        hits.add_row(
            r["config"],
            pool,
            str(r["local_blocks_per_instance"]),
            f"{r['hit_ratio']:.3f}",
            f"{r['local_hit_ratio']:.3f}",
            f"{r['pool_hit_ratio']:.3f}",
            "-" if ref is None else f"{ref:.3f}",
        )
        gpu = r["prefill_gpu_s_saved"]
        work.add_row(
            r["config"],
            str(r["pool_blocks"]),
            f"{r['prefill_tokens_saved']:,}",
            "-" if gpu is None else f"{gpu:,}",
            str(r["puts_per_s"]),
            str(r["gets_per_s"]),
            str(r["put_failures"]),
            str(r["wrong_bytes"]),
        )
        if "put_ms" in r:
            tails.append(
                f"{r['config']}, pool {r['pool_blocks']}: latency ms p50/p99 "
                + ", ".join(
                    f"{op} {r[op + '_ms'].get('p50', '-')}/{r[op + '_ms'].get('p99', '-')}"
                    for op in ("exists", "get", "put")
                )
                + f"; dispatch at most {r['max_lag_ms']} ms late"
            )
        if "ttft_ms" in r:
            slo = (
                f"; SLO {r['slo_ttft_ms']:g} ms: {r['slo_attainment']:.1%} of served within it, "
                f"{r['within_slo']:.1%} of all, goodput {r['goodput_rps']} req/s, {r['rejected']} rejected"
                if "slo_ttft_ms" in r
                else ""
            )
            tails.append(
                f"{r['config']} ({r['routing']}): TTFT ms p50/p99 {r['ttft_ms'].get('p50', '-')}/"
                f"{r['ttft_ms'].get('p99', '-')}{slo}"
            )
    out = io.StringIO()
    console = Console(
        file=out, width=width or max(80, shutil.get_terminal_size().columns), no_color=True, highlight=False
    )
    console.print(hits)
    console.print(work)
    return "\n".join([line.rstrip() for line in out.getvalue().rstrip().splitlines()] + tails)


def write_json(rows: list[dict], meta: dict, path: str) -> None:
    text = json.dumps({"meta": meta, "results": rows}, indent=1)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def plot(rows: list[dict], block_bytes: int, path: str, title: str) -> list[str]:
    """Hit ratio vs pool capacity (blocks below, full-scale GiB above), one line per configuration label.
    Writes a PNG whose "Description" metadata lists the series (JSON); returns their labels. Raises
    ConfigError if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError(f"--plot needs matplotlib ({e}); pip install 'kvplugins[plot]'") from None
    series: dict[str, list] = {}
    for r in rows:
        x = r["pool_blocks"] or r["local_blocks_per_instance"] * r["instances"]
        series.setdefault(r["config"], []).append((x, r["hit_ratio"]))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for i, (label, pts) in enumerate(series.items()):  # styles differ: equal lines stay visible
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            label=label,
            marker="os^dv"[i % 5],
            linestyle=("-", "--", ":", "-.")[i % 4],
            markersize=7 - i % 3,
        )
    ax.set_xlabel("capacity (blocks; local caches: all instances together)")
    ax.set_ylabel("blocks hit / blocks looked up")
    ax.set_ylim(0, max([p[1] for pts in series.values() for p in pts] + [0.05]) * 1.15)
    ax.grid(True, alpha=0.3)
    ax.legend()
    gib = block_bytes / (1 << 30)  # binary units, as the table (format_bytes)
    top = ax.secondary_xaxis("top", functions=(lambda b: b * gib, lambda g: g / gib))
    top.set_xlabel("capacity at full scale (GiB)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, metadata={"Description": json.dumps({"series": list(series)})})
    plt.close(fig)
    return list(series)
