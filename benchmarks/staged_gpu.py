#!/usr/bin/env python3
"""Staged pages on a real GPU (layout/staged.py): how fast a CUDA KV cache saves to and loads from the store, next
to the same pages in CPU KV moved directly, and to the bare PCIe copies (torch, pinned memory) of the same bytes.

The KV is Llama-3-8B shaped by default: 32 layers x [2 (K/V), num_blocks, block=16, kv_heads=8, head=128]
bfloat16, one page = one block of every layer (2 MiB). A store (`kvplugins up`, master and one DRAM segment
in one process on loopback, shm transport) runs beside the benchmark. Per repeat and per case: save --pages
pages (new keys each time), then load them into other blocks; each load is checked byte for byte once. GB =
1e9 bytes; medians over --repeat. Prints one JSON line per case; --json writes them all.

  python3 benchmarks/staged_gpu.py --pages 256 --repeat 5 --json staged_gpu.json

Needs torch with CUDA for the cuda cases (without it only the CPU cases run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kvplugins.layout import KeySpace, PageLayout, PageStore
from kvplugins.layout.staged import SLOTS, StagedPages
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.embedded import CLI, read_discovery
from machine import cpu_model


def start_store(segment: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    disc = tmp / "up.json"
    env = {**os.environ, "KVPLUGINS_UP_DISCOVERY_FILE": str(disc)}
    proc = subprocess.Popen(
        CLI + ["up", "--segment-size", segment], env=env, stdout=open(tmp / "up.log", "w"), stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = read_discovery(disc)
        if info:
            return proc, info["master"]
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"kvplugins up did not start: {(tmp / 'up.log').read_text()[-2000:]}")


def kv(args, device: str, seed: int | None) -> list[torch.Tensor]:
    shape = (2, args.blocks, 16, args.kv_heads, args.head)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(args.layers)]
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in range(args.layers)]


def page_store(master: str, tensors, page_bytes: int, staged: bool, bounce: int) -> PageStore:
    lay = PageLayout.from_tensors(tensors, block_dim=1)
    ks = KeySpace(
        model="bench",
        kv_dtype="bfloat16",
        block_size=16,
        layer_group=f"l{len(tensors)}",
        tp_rank=0,
        tp_size=1,
        page_bytes=page_bytes,
    )
    stage = StagedPages(lay, bounce, slot_timeout_s=30) if staged else None
    return PageStore(lambda: StoreClient(ClientConfig(master=master)), ks, lay, staged=stage)


def hashes(n: int, salt: int) -> list[bytes]:
    return [salt.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def case(args, master: str, name: str, device: str, staged: bool, salt0: int) -> dict:
    src, dst = kv(args, device, 1), kv(args, device, None)
    page_bytes = args.layers * 2 * 16 * args.kv_heads * args.head * 2
    save_s, load_s = [], []
    p, q = (page_store(master, t, page_bytes, staged, args.bounce_mib << 20) for t in (src, dst))
    n = args.pages
    for r in range(args.repeat + 1):  # the first round warms the bounce slots and the client
        hs = hashes(n, salt0 + r)
        sync()
        t0 = time.perf_counter()
        if p.save(list(range(n)), hs) != n:
            raise SystemExit(f"{name}: a save stored fewer than {n} pages: {p.stats}")
        sync()
        t1 = time.perf_counter()
        if q.load(list(range(n, 2 * n)), hs) != []:
            raise SystemExit(f"{name}: a load failed pages: {q.stats}")
        sync()
        t2 = time.perf_counter()
        if r == 0:
            for a, b in zip(src, dst):
                assert torch.equal(a[:, :n], b[:, n : 2 * n]), f"{name}: loaded bytes differ"
        else:
            save_s.append(t1 - t0)
            load_s.append(t2 - t1)
    p.close(), q.close()
    nbytes = n * page_bytes
    return {
        "case": name,
        "pages": n,
        "page_bytes": page_bytes,
        "save_ms": round(statistics.median(save_s) * 1e3, 2),
        "load_ms": round(statistics.median(load_s) * 1e3, 2),
        "save_GBps": round(nbytes / statistics.median(save_s) / 1e9, 2),
        "load_GBps": round(nbytes / statistics.median(load_s) / 1e9, 2),
    }


def pcie(args) -> dict:
    """The bare copies the staged path adds: every layer's n blocks, device -> pinned host and back."""
    src = kv(args, "cuda", 1)
    n = args.pages
    host = [torch.empty_like(t[:, :n], device="cpu").pin_memory() for t in src]
    d2h, h2d = [], []
    for r in range(args.repeat + 1):
        sync()
        t0 = time.perf_counter()
        for h, t in zip(host, src):
            h.copy_(t[:, :n], non_blocking=True)
        sync()
        t1 = time.perf_counter()
        for h, t in zip(host, src):
            t[:, n : 2 * n].copy_(h, non_blocking=True)
        sync()
        if r:
            d2h.append(t1 - t0)
            h2d.append(time.perf_counter() - t1)
    nbytes = sum(h.numel() * h.element_size() for h in host)
    return {
        "case": "pcie copies alone (torch, pinned)",
        "d2h_ms": round(statistics.median(d2h) * 1e3, 2),
        "h2d_ms": round(statistics.median(h2d) * 1e3, 2),
        "d2h_GBps": round(nbytes / statistics.median(d2h) / 1e9, 2),
        "h2d_GBps": round(nbytes / statistics.median(h2d) / 1e9, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=256, help="pages per save/load")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--bounce-mib", type=int, default=256, help=f"staging bounce memory ({SLOTS} slots), MiB")
    ap.add_argument("--segment-size", default="8GiB")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    args.blocks = 2 * args.pages
    rows = [
        {
            "cpu": cpu_model(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        }
    ]
    print(json.dumps(rows[0]), flush=True)
    with tempfile.TemporaryDirectory(prefix="kvp-staged-gpu-") as tmp:
        proc, master = start_store(args.segment_size, Path(tmp))
        try:
            cases = [("cpu KV, direct", "cpu", False, 100), ("cpu KV, staged (forced)", "cpu", True, 200)]
            if torch.cuda.is_available():
                cases.append(("cuda KV, staged", "cuda", True, 300))
            for name, device, staged, salt in cases:
                rows.append(case(args, master, name, device, staged, salt))
                print(json.dumps(rows[-1]), flush=True)
            if torch.cuda.is_available():
                rows.append(pcie(args))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
