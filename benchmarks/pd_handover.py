"""P/D direct handover on one host (kvplugins/layout/handover.py): decode reading a prefill worker's KV blocks
over the transfer core's cma transport (process_vm_readv) vs its tcp transport, in the same run.

    .venv/bin/python benchmarks/pd_handover.py [--layers 16] [--block-kib 32] [--pages 1,32] [--repeat 20]

A producer process holds ``2 * layers`` KV planes (K and V per layer) of 256 blocks of ``block-kib`` KiB in
ordinary numpy memory (as vLLM's KV tensors: no shm file), exports them and holds a lease; this process reads
``pages`` pages (one span per plane per page) into its own blocks, lease checks included, as decode does. Prints
per page count the median ms of a read and GB/s for cma and tcp, and their ratio; one JSON line each with
--json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import numpy as np

from kvplugins.layout import PageLayout
from kvplugins.layout.handover import Consumer, Offer, Producer
from kvplugins.transfer import TransferConfig

BLOCKS = 256
SLOT, TOKEN = 1, 4242


def _kv(layers: int, block_bytes: int, seed: int | None) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 255, size=(2, BLOCKS, block_bytes), dtype=np.uint8)
        if seed is not None
        else np.zeros((2, BLOCKS, block_bytes), dtype=np.uint8)
        for _ in range(layers)
    ]


def _producer(conn, layers: int, block_bytes: int) -> None:
    kv = _kv(layers, block_bytes, seed=1)
    p = Producer(PageLayout.from_tensors(kv, block_dim=1), TransferConfig(transports="shm,cma,tcp"))
    p.lease(SLOT, TOKEN)
    conn.send(p.offer.to_wire())
    conn.recv()
    p.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--block-kib", type=int, default=32)
    ap.add_argument("--pages", default="1,32")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    block_bytes = args.block_kib << 10
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_producer, args=(child, args.layers, block_bytes), daemon=True)
    proc.start()
    offer = Offer.from_wire(parent.recv())
    layout = PageLayout.from_tensors(kv := _kv(args.layers, block_bytes, None), block_dim=1)
    try:
        for pages in [int(x) for x in args.pages.split(",")]:
            row = {"pages": pages, "page_bytes": layout.page_bytes}
            for path in ("cma", "tcp"):
                consumer = Consumer(layout, TransferConfig(transports=f"shm,{path}"), wait_ms=1000)
                ids = list(range(pages))
                times = []
                for _ in range(args.repeat + 1):  # the first read connects / opens the pidfd: not counted
                    t0 = time.perf_counter()
                    if consumer.read(offer, ids, ids, SLOT, TOKEN):
                        raise SystemExit(f"{path}: a read failed")
                    times.append(time.perf_counter() - t0)
                assert consumer.engine.stats()[path]["entries"] > 0 and kv[0][0, 0].any()
                consumer.close()
                ms = statistics.median(times[1:]) * 1000
                row[f"{path}_ms"], row[f"{path}_GBps"] = round(ms, 3), round(pages * layout.page_bytes / ms / 1e6, 2)
            row["cma_vs_tcp_time"] = round(row["cma_ms"] / row["tcp_ms"], 3)
            print(
                json.dumps(row)
                if args.json
                else f"{pages:>4} pages of {layout.page_bytes >> 10} KiB: cma {row['cma_ms']} ms ({row['cma_GBps']} GB/s), "
                f"tcp {row['tcp_ms']} ms ({row['tcp_GBps']} GB/s), cma/tcp time {row['cma_vs_tcp_time']}"
            )
    finally:
        parent.send("exit")
        proc.join(10)


if __name__ == "__main__":
    main()
