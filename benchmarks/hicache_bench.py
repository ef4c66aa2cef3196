"""HiCache L3 throughput through SGLang 0.5.23's own cache-controller page IO: kvplugins vs SGLang's ``file`` and
``mooncake`` backends, side by side in one run (issue #3).

    sudo .venv/bin/python benchmarks/hicache_bench.py                 # all backends (Mooncake in a private netns)
    .venv/bin/python benchmarks/hicache_bench.py --no-mooncake        # kvplugins + file only, no root needed

Pool shaped like Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16, page 64 tokens (8 MiB per page, K+V),
layouts page_first and layer_first. ``file`` reads pages back from the page cache (they were just written);
``file-cold`` drops them from it first (untimed), as an L3 read of pages written long ago. Per backend and round:
``page_set_func`` (backup, host -> L3) of a batch of pages, then ``page_get_func`` (prefetch, L3 -> a second host
pool); every page read is checked bit-exact (sha256) against what was written, untimed. ``--warmup`` untimed rounds
come first, so each store has seen its segment written once, as in a long-running engine (a client's first write
into a fresh mapping of a peer's segment pays a page fault per 4 KiB). Backends run interleaved round by round, so
a change of machine load hits all alike. Reported: median pages/s and GB/s (1e9 B) per op, and the ratios of
kvplugins to file and mooncake.

Servers: kvplugins master + one store node (shm, and TCP forced), mooncake_master + one segment process, both from
benchmarks/storebench/clusters.py; the SGLang-side clients live in this process like an SGLang rank's backend.
SGLang's mooncake backend refuses MHA layer_first (its multi-buffer path is MLA-only): that cell reads n/a.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests" / "sglang")]

import sglang_cpu  # noqa: E402  (triton/torchvision stand-ins on this CPU-only machine)

sglang_cpu.install()

import torch  # noqa: E402
from storebench import netns  # noqa: E402

import hicache_pools  # noqa: E402
from hicache import backends  # noqa: E402

GEOMETRY = dict(layers=32, heads=8, head_dim=128, page_size=64, dtype=torch.bfloat16)
PAGE_BYTES = 2 * 32 * 8 * 128 * 2 * 64  # K+V, layers, heads, head dim, bf16, tokens: 8 MiB


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pages", type=int, default=16, help="pages per batch (8 MiB each)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per backend, op and layout")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed (verified) rounds first, per backend; "
        "default: enough to write our segment once, as a long-running engine has (store_bench does so)",
    )
    p.add_argument("--layouts", default="page_first,layer_first")
    p.add_argument("--no-mooncake", action="store_true", help="skip Mooncake (no root / netns needed)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--log-dir", type=Path, help="server logs and the file backend's pages (default: temp dir)")
    return p.parse_args(argv)


def digests(pool, first: int, pages: int) -> list[str]:
    ps = pool.page_size
    return [
        hashlib.sha256(pool.get_data_page((first + i) * ps).contiguous().view(torch.uint8).numpy()).hexdigest()
        for i in range(pages)
    ]


def one_round(att, reader, keys, idx, expect, first) -> dict:
    """Time one set (from the writer pool) and one get (into the reader pool); verify the bytes."""
    reader.pool.kv_buffer.zero_()
    t0 = time.perf_counter()
    ok = att.set(keys, idx)
    t1 = time.perf_counter()
    if att.after_set is not None:
        att.after_set()
        t1 = time.perf_counter()
    loaded = reader.get(keys, idx)
    t2 = time.perf_counter()
    good = ok and loaded == len(keys) and digests(reader.pool, first, len(keys)) == expect
    return {"set_s": t1 - t0, "get_s": t2 - t1, "verified": bool(good)}


def run_layout(layout: str, args, factories: dict) -> list[dict]:
    pages = args.pages
    writer_pool = hicache_pools.mha_pool(layout, pages=pages, **GEOMETRY)
    reader_pool = hicache_pools.mha_pool(layout, pages=pages, **GEOMETRY)
    writer_pool.kv_buffer.copy_(torch.randn(writer_pool.kv_buffer.shape).to(torch.bfloat16))
    first, page_bytes = 1, writer_pool.get_size_per_token() * writer_pool.page_size
    idx = torch.arange(first * 64, (first + pages) * 64, dtype=torch.int64)
    expect = digests(writer_pool, first, pages)
    pairs, rows = {}, []
    for label, make in factories.items():
        try:
            pairs[label] = (make(writer_pool), make(reader_pool))
        except Exception as e:  # noqa: BLE001 - a backend that cannot attach is reported, not fatal
            rows.append({"layout": layout, "backend": label, "error": f"attach: {e!r}"[:300]})
    samples = {label: [] for label in pairs}
    for r in range(-args.warmup, args.rounds):
        for label, (att, reader) in pairs.items():
            keys = [hashlib.sha256(f"{layout}/{label}/{r}/{i}".encode()).hexdigest() for i in range(pages)]
            try:
                sample = one_round(att, reader, keys, idx, expect, first)
            except Exception as e:  # noqa: BLE001 - e.g. mooncake's MHA layer_first refusal
                sample = {"error": repr(e)[:300]}
            if r >= 0 or "error" in sample or not sample["verified"]:
                samples[label].append(sample)
    for label, (att, reader) in pairs.items():
        att.close()
        reader.close()
        rows.append(summarize(layout, label, samples[label], pages, page_bytes))
    pairs.clear()
    gc.collect()  # backends' native clients go away while their servers still run
    return rows


def summarize(layout, label, samples, pages, page_bytes) -> dict:
    errors = [s["error"] for s in samples if "error" in s]
    if errors:
        return {"layout": layout, "backend": label, "error": errors[0]}
    row = {
        "layout": layout,
        "backend": label,
        "verified": all(s["verified"] for s in samples),
        "page_bytes": page_bytes,
        "pages": pages,
    }
    for op in ("set", "get"):
        t = statistics.median(s[f"{op}_s"] for s in samples)
        row[f"{op}_pages_s"], row[f"{op}_GBps"] = pages / t, pages * page_bytes / t / 1e9
    return row


def table(rows: list[dict]) -> str:
    out = ["| layout | backend | set pages/s | set GB/s | get pages/s | get GB/s | verified |", "|---" * 7 + "|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['layout']} | {r['backend']} | n/a | n/a | n/a | n/a | {r['error'][:80]} |")
        else:
            out.append(
                f"| {r['layout']} | {r['backend']} | {r['set_pages_s']:.1f} | {r['set_GBps']:.2f} | "
                f"{r['get_pages_s']:.1f} | {r['get_GBps']:.2f} | {r['verified']} |"
            )
    return "\n".join(out)


def ratios(rows: list[dict]) -> list[str]:
    by = {(r["layout"], r["backend"]): r for r in rows if "error" not in r}
    out = []
    for (layout, label), r in by.items():
        if not label.startswith("kvp"):
            continue
        for other in ("file", "file-cold", "mooncake-tcp"):
            o = by.get((layout, other))
            if o:
                out.append(
                    f"{layout} {label} / {other}: set x{r['set_GBps'] / o['set_GBps']:.2f}, "
                    f"get x{r['get_GBps'] / o['get_GBps']:.2f}"
                )
    return out


def git_rev() -> str:
    """Short commit of the checkout, with "+dirty" if it has uncommitted changes."""

    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--", "kvplugins") else "")


def main(argv=None) -> int:
    args = parse(argv)
    if args.warmup is None:
        batch = args.pages * PAGE_BYTES
        args.warmup = -(-max(512 << 20, 4 * batch) // batch)  # our segment (storebench.clusters.kvp) / batch
    if not args.no_mooncake and not netns.inside():
        return netns.run_inside([str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])])
    run = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_rev(),
        "load_start": os.getloadavg()[0],
    }
    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hicache-bench-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        rows = []
        for layout in args.layouts.split(","):
            rows += run_layout_with_servers(layout, args, log_dir)
    run["load_end"] = os.getloadavg()[0]
    print(
        f"{run['date']} kvplugins {run['git']}, 1-min load {run['load_start']:.1f} -> {run['load_end']:.1f}, "
        f"{args.pages} pages x {args.rounds} rounds after {args.warmup} warm-up rounds"
    )
    print(table(rows))
    print("\n".join(ratios(rows)))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    **run,
                    "geometry": {k: str(v) for k, v in GEOMETRY.items()},
                    "pages": args.pages,
                    "rounds": args.rounds,
                    "warmup": args.warmup,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0 if all(r.get("verified", True) for r in rows) else 1


def run_layout_with_servers(layout: str, args, log_dir: Path) -> list[dict]:
    """Fresh servers per layout. Ours are sized for one round (512 MiB at least; LRU eviction drops older rounds,
    which are never read again); Mooncake's segment holds every round (its put fails rather than waits when full)."""
    batch = args.pages * PAGE_BYTES
    with contextlib.ExitStack() as stack:
        factories = {
            "kvp-shm": stack.enter_context(backends.kvp("shm", batch, log_dir)),
            "kvp-tcp": stack.enter_context(backends.kvp("tcp", batch, log_dir)),
            "file": stack.enter_context(backends.file(log_dir)),
            "file-cold": stack.enter_context(backends.file(log_dir, cold=True)),
        }
        if not args.no_mooncake:
            rounds = args.warmup + args.rounds
            factories["mooncake-tcp"] = stack.enter_context(backends.mooncake(rounds * batch, log_dir))
        return run_layout(layout, args, factories)


if __name__ == "__main__":
    sys.exit(main())
