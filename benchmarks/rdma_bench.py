"""RDMA transport vs perftest on the same device in the same run: batch READ/WRITE of 32 x 1 MiB against
ib_read_bw / ib_write_bw (-s 1 MiB), a single 4 KiB read against ib_read_lat (-s 4096), and our CPU time per
posted work request. Rounds alternate perftest and ours; medians and ratios are printed with the CPU model.

Runs where an RDMA device is (on these machines: the soft-RoCE guest, everything 10-50x slower than the host,
so compare only the ratios):
    bash ci/rxe-guest.sh --nics 1 -- .venv/bin/python benchmarks/rdma_bench.py --json '$RXE_GUEST_OUT/rdma.json'
perftest's "MB/sec" is 2^20 bytes per second (perftest_parameters.c: format_factor 0x100000); so is ours here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import time

import numpy as np

from kvplugins.transfer import SegmentDescriptor, TransferConfig, TransferEngine, TransferRequest
from kvplugins.transfer.nics import discover
from machine import cpu_model

MIB = 1 << 20
PEER_BYTES = 64 * MIB
SMALL, SMALL_N, SMALL_STRIDE = 4096, 1024, 8192  # the per-work-request CPU case: scattered 4 KiB reads


def _peer(conn, host: str) -> None:
    """The serving process: one exported 64 MiB region; its descriptor goes back over ``conn``."""
    eng = TransferEngine(TransferConfig(transports="rdma,tcp", host=host))
    region = eng.alloc_shared(PEER_BYTES)
    eng.memoryview(region)[:] = np.random.default_rng(0).bytes(PEER_BYTES)
    conn.send((eng.descriptor().to_wire(), region.region_id))
    conn.recv()
    eng.close()


PERFTEST_PORT = 18515  # perftest's default port


def _wait_listening(server: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Until perftest's server listens on PERFTEST_PORT (its client, started before, fails at once)."""
    end = time.monotonic() + timeout_s
    while not subprocess.run(["ss", "-Hltn", f"sport = :{PERFTEST_PORT}"], capture_output=True, text=True).stdout:
        if server.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"perftest's server did not listen on port {PERFTEST_PORT}: {server.stdout.read()}")
        time.sleep(0.05)


def perftest(tool: str, nic, size: int, iters: int, cpu: dict | None = None) -> float:
    """One perftest run on ``nic`` over its own address: MB/sec average (bw tools) or t_typical µs (lat). With
    ``cpu``, its client's user and system CPU µs per iteration go there (set-up included)."""
    args = [
        tool,
        "-d",
        nic.name,
        "-i",
        str(nic.port),
        "-x",
        str(nic.gid_index),
        "-s",
        str(size),
        "-n",
        str(iters),
        "-F",
        "-p",
        str(PERFTEST_PORT),
    ]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_listening(server)
    proc = subprocess.Popen(
        args + [nic.ipv4.split("/")[0]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out = proc.stdout.read() if proc.stdout else ""
    _, _, usage = os.wait4(proc.pid, 0)  # the client's own CPU (rusage), which communicate() would not give
    proc.returncode = 0
    server.wait(60)
    if cpu is not None:
        cpu.update(user=usage.ru_utime * 1e6 / iters, system=usage.ru_stime * 1e6 / iters)
    row = [ln.split() for ln in out.splitlines() if re.match(rf"\s*{size}\s+{iters}\s", ln)]
    if not row:
        raise RuntimeError(f"{tool} printed no result:\n{out}")
    return float(row[0][3] if tool.endswith("_bw") else row[0][4])  # BW average[MB/sec] | t_typical[usec]


class Ours:
    """A client engine and a peer process; timed batches against the peer's region."""

    def __init__(self, host: str):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_peer, args=(child, host), daemon=True)
        self._proc.start()
        wire, self.region = self._conn.recv()
        self.desc = SegmentDescriptor.from_wire(wire)
        self.eng = TransferEngine(TransferConfig(transports="rdma,tcp", host=host, timeout_ms=120000))
        self.buf = np.zeros(40 * MIB, np.uint8)
        self.reg = self.eng.register(self.buf)

    def batch(self, read: bool, n: int, size: int, stride: int, spans: bool = False) -> float:
        """Seconds for one batch of ``n`` entries of ``size`` bytes, ``stride`` apart on both sides: TransferRequest
        objects (batch_read/batch_write), or with ``spans`` the array form the store uses (read_spans/write_spans)."""
        if spans:
            offs = np.arange(n, dtype=np.uint64) * np.uint64(stride)
            args = (self.desc, self.region, offs + np.uint64(self.reg.addr), offs, np.full(n, size, np.uint64))
            fn = self.eng.read_spans if read else self.eng.write_spans
            t = time.perf_counter()
            st = fn(*args)
            dt = time.perf_counter() - t
            if st.count(None) != n:
                raise RuntimeError(f"batch failed: {[e for e in st if e][:1]}")
            return dt
        reqs = [TransferRequest(self.reg, i * stride, self.desc, self.region, i * stride, size) for i in range(n)]
        t = time.perf_counter()
        st = (self.eng.batch_read if read else self.eng.batch_write)(reqs)
        dt = time.perf_counter() - t
        if st.count(None) != n:
            raise RuntimeError(f"batch failed: {[e for e in st if e][:1]}")
        return dt

    def cpu_per_wr(self, rounds: int, n: int, size: int, stride: int, spans: bool = False) -> dict[str, float]:
        """CPU µs per posted work request over ``rounds`` batches: user (our Python and native verbs layer) and
        system (the kernel, where soft-RoCE does the NIC's work inside ibv_post_send)."""
        wrs0, t0 = self.eng.stats()["rdma"]["wrs"], os.times()
        for _ in range(rounds):
            self.batch(True, n, size, stride, spans)
        t1, wrs = os.times(), self.eng.stats()["rdma"]["wrs"] - wrs0
        return {"user": (t1.user - t0.user) * 1e6 / wrs, "system": (t1.system - t0.system) * 1e6 / wrs}

    def close(self) -> None:
        self.eng.close()
        self._conn.send("exit")
        self._proc.join(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of perftest and ours (medians)")
    p.add_argument("--lat-samples", type=int, default=200, help="single 4 KiB reads per round")
    p.add_argument("--host", default="127.0.0.1", help="TCP control address of our engines")
    p.add_argument("--json", default="", help="write every number here")
    args = p.parse_args()
    nics = [n for n in discover().nics if n.usable]
    if not nics:
        raise SystemExit(
            f"no usable RDMA NIC ({discover().reason}); run it in the soft-RoCE guest: "
            "bash ci/rxe-guest.sh -- .venv/bin/python benchmarks/rdma_bench.py"
        )
    nic, ours = nics[0], Ours(args.host)
    keys = ("ib_read_bw", "ib_write_bw", "ib_read_lat", "read", "write", "lat", "lat_spans")
    rows: dict[str, list[float]] = {k: [] for k in keys}
    try:
        ours.batch(True, 32, MIB, MIB)  # connect QPs, warm up
        for _ in range(args.rounds):
            rows["ib_read_bw"].append(perftest("ib_read_bw", nic, MIB, 64))
            rows["read"].append(32 / ours.batch(True, 32, MIB, MIB))
            rows["ib_write_bw"].append(perftest("ib_write_bw", nic, MIB, 64))
            rows["write"].append(32 / ours.batch(False, 32, MIB, MIB))
            rows["ib_read_lat"].append(perftest("ib_read_lat", nic, SMALL, 500))
            rows["lat"].append(
                statistics.median(ours.batch(True, 1, SMALL, SMALL) * 1e6 for _ in range(args.lat_samples))
            )
            rows["lat_spans"].append(
                statistics.median(ours.batch(True, 1, SMALL, SMALL, True) * 1e6 for _ in range(args.lat_samples))
            )
        cpu = {
            "4KiB_scattered": ours.cpu_per_wr(3, SMALL_N, SMALL, SMALL_STRIDE),
            "4KiB_scattered_spans": ours.cpu_per_wr(3, SMALL_N, SMALL, SMALL_STRIDE, spans=True),
            "1MiB": ours.cpu_per_wr(3, 32, MIB, MIB),
        }
        perftest("ib_read_bw", nic, SMALL, 3 * SMALL_N, cpu.setdefault("perftest_ib_read_bw_4KiB_polling", {}))
    finally:
        ours.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "cpu": cpu_model(),
        "host_cpu": os.environ.get("RXE_HOST_CPU", ""),
        "kernel": platform.release(),
        "nic": nic.name,
        "mtu": nic.active_mtu,
        "rounds": args.rounds,
        "medians": med,
        "samples": rows,
        "ratios": {
            "read_vs_ib_read_bw": med["read"] / med["ib_read_bw"],
            "write_vs_ib_write_bw": med["write"] / med["ib_write_bw"],
            "lat_vs_ib_read_lat": med["lat"] / med["ib_read_lat"],
            "lat_spans_vs_ib_read_lat": med["lat_spans"] / med["ib_read_lat"],
        },
        "cpu_us_per_wr": cpu,
    }
    _report(result)
    if args.json:
        path = os.path.expandvars(args.json)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")


def _report(r: dict) -> None:
    m, q = r["medians"], r["ratios"]
    print(
        f"CPU {r['cpu']} (host: {r['host_cpu'] or 'unknown'}) | kernel {r['kernel']} | {r['nic']} MTU {r['mtu']} | medians of {r['rounds']} rounds"
    )
    print(f"{'case':34} {'ours':>10} {'perftest':>10} {'ratio':>7}")
    print(f"{'READ 32 x 1 MiB (MiB/s)':34} {m['read']:10.1f} {m['ib_read_bw']:10.1f} {q['read_vs_ib_read_bw']:7.2f}")
    print(
        f"{'WRITE 32 x 1 MiB (MiB/s)':34} {m['write']:10.1f} {m['ib_write_bw']:10.1f} {q['write_vs_ib_write_bw']:7.2f}"
    )
    print(f"{'single 4 KiB read p50 (us)':34} {m['lat']:10.1f} {m['ib_read_lat']:10.1f} {q['lat_vs_ib_read_lat']:7.2f}")
    lat_s = q["lat_spans_vs_ib_read_lat"]
    print(f"{'  the same, read_spans (us)':34} {m['lat_spans']:10.1f} {m['ib_read_lat']:10.1f} {lat_s:7.2f}")
    for case, c in r["cpu_us_per_wr"].items():
        print(f"CPU us per posted work request, {case}: user {c['user']:.1f}, system {c['system']:.1f}")


if __name__ == "__main__":
    main()
