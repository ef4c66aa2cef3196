#!/usr/bin/env python3
"""Disk-tier benchmark (issue #6): offload throughput (DRAM -> durable files, as the watermark sweep drives it)
and the cost of a get that has to promote an object from disk, next to a DRAM hit of the same size.

One `kvplugins master` and one `kvplugins store --disk-dir DIR` run as separate processes; the client (this
process) fills 95% of the segment through a registered buffer, times until the sweep's offloads brought it
under the low watermark (offload throughput: fsynced files), then times single gets of disk-only objects (promote + read), 32-key batch gets of disk-only objects,
and single DRAM hits. Every get is checked byte for byte. Use ``--disk-dir`` on the device you mean to measure
(the default temp dir may be tmpfs, which measures no disk).

  .venv/bin/python benchmarks/disk_tier_bench.py --disk-dir /nvme/kvp-bench --sizes 64KiB,1MiB
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvplugins.config import parse_bytes
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.embedded import CLI
from kvplugins.store.wire.protocol import OK, ON_DISK


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--disk-dir", help="disk-tier directory (default: a temp dir)")
    p.add_argument("--sizes", default="64KiB,1MiB", help="object sizes")
    p.add_argument("--segment-size", default="128MiB", help="the node's DRAM segment")
    p.add_argument("--objects", type=int, default=0, help="objects per size (default: 95%% of the segment)")
    p.add_argument("--samples", type=int, default=200, help="timed single gets per kind")
    p.add_argument("--disk-threads", default="4", help="the node's --disk-threads")
    p.add_argument("--json", help="write results here")
    return p.parse_args(argv)


@contextlib.contextmanager
def cluster(disk_dir: Path, segment_size: str, tmp: Path, threads: str = "4"):
    procs = []

    def spawn(args, name):
        log = open(tmp / f"{name}.log", "wb")
        procs.append(subprocess.Popen(CLI + args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def wait(path: Path) -> str:
        for _ in range(1000):
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            time.sleep(0.02)
        raise RuntimeError(f"{path} never appeared; logs in {tmp}")

    try:
        spawn(
            [
                "master",
                "--port",
                "0",
                "--port-file",
                str(tmp / "port"),
                "--high-watermark",
                "0.5",
                "--low-watermark",
                "0.25",
                "--lease-ttl-ms",
                "500",
            ],
            "master",
        )
        master = wait(tmp / "port")
        spawn(
            [
                "store",
                "--master",
                master,
                "--segment-size",
                segment_size,
                "--disk-dir",
                str(disk_dir),
                "--disk-capacity",
                "64GiB",
                "--disk-threads",
                threads,
                "--ready-file",
                str(tmp / "ready"),
            ],
            "node",
        )
        wait(tmp / "ready")
        yield master
    finally:
        for p in procs:
            p.kill()
            p.wait()


def settle(rpc, timeout: float = 300.0) -> None:
    t0 = time.monotonic()
    while True:
        st = rpc.call("status")
        if st["disk_flights"] == 0 and st["bytes_used"] <= 0.5 * st["bytes_total"]:
            return
        if time.monotonic() - t0 > timeout:
            raise RuntimeError("offloads did not settle")
        time.sleep(0.01)


def run_size(client, size: int, n: int, samples: int) -> dict:
    src = np.random.default_rng(size).integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros(32 * size, dtype=np.uint8)
    a, b = client.register_buffer(src).addr, client.register_buffer(dst).addr
    keys = [f"{size}/{i}" for i in range(n)]
    rpc = client._rpc
    before = rpc.call("status")
    for j in range(0, n, 32):  # up to 95% of the segment: over high, so the sweep offloads down to low
        batch = range(j, min(n, j + 32))
        errs = client.batch_put_from([keys[i] for i in batch], [[(a + i * size, size)] for i in batch])
        assert errs == [None] * len(batch), errs
    t0 = time.perf_counter()
    settle(rpc)
    took = time.perf_counter() - t0
    st = rpc.call("status")
    offloaded = st["offloads"] - before["offloads"]
    codes = [code for code, _ in rpc.call("get", keys)]
    on_disk = [i for i, code in enumerate(codes) if code == ON_DISK]
    in_dram = [i for i, code in enumerate(codes) if code == OK]

    def single(indices):
        times = []
        for i in indices[:samples]:
            dst[:size] = 0
            t = time.perf_counter()
            client.get_into(keys[i], [(b, size)])
            times.append(time.perf_counter() - t)
            assert np.array_equal(dst[:size], src[i * size : (i + 1) * size]), f"wrong bytes for {keys[i]}"
        return times

    promote = single(on_disk[: len(on_disk) // 2])
    hit = single(in_dram)
    batches, misses = [], 0
    rest = on_disk[len(on_disk) // 2 :]
    for j in range(0, len(rest) - 31, 32):
        idx = rest[j : j + 32]
        t = time.perf_counter()
        errs = client.batch_get_into([keys[i] for i in idx], [[(b + k * size, size)] for k in range(32)])
        batches.append(time.perf_counter() - t)
        misses += sum(e is not None for e in errs)  # DRAM full of leased objects: the promotion misses
        for k, i in enumerate(idx):
            assert errs[k] is not None or np.array_equal(dst[k * size : (k + 1) * size], src[i * size : (i + 1) * size])
    client.batch_remove(keys)
    while rpc.call("status")["zombies"]:  # removed objects free their DRAM when the readers' leases end
        time.sleep(0.05)
    return {
        "size": size,
        "objects": n,
        "offloaded": offloaded,
        "dropped": n - len(on_disk) - len(in_dram),
        "offload_s": round(took, 3),
        "offload_MBps": round(offloaded * size / took / 1e6, 1),
        "promote_get_us": _pcts(promote),
        "dram_get_us": _pcts(hit),
        "promote_batch32_ms": _pcts(batches, 1e3),
        "batch_misses": misses,
    }


def _pcts(times, scale=1e6) -> dict:
    if not times:
        return {}
    t = np.array(times) * scale
    return {"n": len(t), "p50": round(float(np.percentile(t, 50)), 1), "p99": round(float(np.percentile(t, 99)), 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvp-disk-bench-") as tmp:
        disk = Path(args.disk_dir or tmp) / f"kvp-disk-bench-{os.getpid()}"  # fresh: no files announced
        results = []
        with (
            cluster(disk, args.segment_size, Path(tmp), args.disk_threads) as master,
            StoreClient(ClientConfig(master=master, rpc_timeout_ms=10000)) as client,
        ):
            for size in [parse_bytes(s) for s in args.sizes.split(",")]:
                n = args.objects or int(0.95 * parse_bytes(args.segment_size)) // size
                results.append(run_size(client, size, n, args.samples))
                print(json.dumps(results[-1]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"disk_dir": str(disk), "results": results}, indent=1))
        shutil.rmtree(disk, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
