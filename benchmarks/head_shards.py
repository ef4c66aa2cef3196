"""Pages stored per KV head (issue #32): one batch RPC for every head's objects vs one RPC per head.

A TP rank stores each page as one object per KV head it holds (kvplugins/layout/shards.py), so any TP size reads
what another wrote. ``load_pages`` / ``save_pages`` (kvplugins/layout/pages.py) move every head's objects of a
batch in one ``batch_get_into`` / one exists + one ``batch_put_from``; the anchor is the same objects moved head
by head (``PageStore.load`` per head, what HeadShards did before). A store (`tests/helpers/cluster.py`: one
master, one node, loopback shm) holds the pages; the KV is a torch tensor per layer shaped as vLLM CPU's LBHNC
([blocks, heads, block tokens, 2 x head dim], fp32). Prints a markdown table of medians and ratios.

    .venv/bin/python benchmarks/head_shards.py [--heads 8] [--layers 24] [--pages 64] [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from machine import cpu_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=8, help="KV heads this rank holds (objects per page)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--pages", type=int, default=64, help="pages per batch")
    ap.add_argument("--block", type=int, default=16, help="tokens per page")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import torch
    from helpers.cluster import store_cluster

    from kvplugins.layout import KeySpace
    from kvplugins.layout.pages import PageStore, load_pages, save_pages
    from kvplugins.layout.spans import PageLayout, head_planes
    from kvplugins.store import ClientConfig, StoreClient

    blocks = args.pages + 8
    layers = [torch.randn(blocks, args.heads, args.block, 2 * args.head_dim) for _ in range(args.layers)]
    page = args.layers * args.heads * args.block * 2 * args.head_dim * 4
    with store_cluster(nodes=1, segment_size=f"{max(64, 3 * args.pages * page >> 20)}MiB") as c:

        def factory():
            return StoreClient(ClientConfig(master=c.master, rpc_timeout_ms=5000))

        parts: list[PageStore] = []
        for h in range(args.heads):
            lay = PageLayout([p for t in layers for p in head_planes(t, 0, args.heads, h)])
            ks = KeySpace(
                model="bench",
                kv_dtype="float32",
                block_size=args.block,
                layer_group="all",
                tp_rank=h,
                tp_size=args.heads,
                page_bytes=lay.page_bytes,
            )
            parts.append(PageStore(factory, ks, lay, share=parts[0] if parts else None))
        ids, hashes = list(range(args.pages)), [i.to_bytes(4, "big") * 8 for i in range(args.pages)]
        assert save_pages(parts, ids, hashes)[0] == args.pages
        cases = {
            "one batch for all heads (load_pages)": lambda: load_pages(parts, ids, hashes),
            "one batch per head (before)": lambda: [p.load(ids, hashes) for p in parts],
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.repeat):  # interleaved, so drift hits both alike
            for name, fn in cases.items():
                t0 = time.perf_counter()
                failed = fn()
                times[name].append(time.perf_counter() - t0)
                assert not any(failed), failed
        for p in parts:
            p.close()
    nbytes = args.pages * page
    print(
        f"{args.pages} pages x {args.heads} heads x {args.layers} layers ({nbytes / 2**20:.0f} MiB per batch), "
        f"{args.repeat} rounds, CPU: {cpu_model()}"
    )
    print("| load | median ms | GB/s | vs one batch |")
    print("|---|---|---|---|")
    first = statistics.median(next(iter(times.values())))
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m * 1000:.1f} | {nbytes / m / 1e9:.2f} | {m / first:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
