"""P2P checkpoint distribution (issue #36): one trainer publishes a checkpoint, N receivers fetch it at once over
rate-limited links; the time until all N hold it, kvplugins.p2p (receivers read from each other as chunks land)
vs every receiver reading from the trainer alone (``--sources owner``: the naive baseline, ~N x the time).

Hosts are network namespaces on one machine with real veth links shaped by tc tbf on both ends
(tests/cluster/net.py): h1 etcd, h2 the trainer (`kvplugins p2p publish`), h3.. the receivers (`kvplugins p2p
fetch --serve`), every process authenticated with one cluster secret, TCP only. T(N) = from launching the N
receivers together to the last one's "fetched" line (Python start included), beside the slowest pull's own
time. Goal: T(8) / T(1) <= 1.5 with P2P. Needs root. Prints a markdown table; ``--json`` writes the rows.

The defaults (100 Mbit/s links, 256 MiB: T(1) ~ 22 s) keep a 2-core machine's network stack off the critical
path: at 200 Mbit/s the 9 hosts' veth/bridge/tbf processing took ~57% of both cores in softirq and the runs
measured the CPU, not the links.

    .venv/bin/python benchmarks/p2p_bench.py [--receivers 1,2,4,8] [--rate 100mbit] [--size 256MiB] [--chunk 4MiB]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
ETCD_PORT = 2379
KVP = [sys.executable, "-c", "import sys; from kvplugins.cli import main; sys.exit(main(sys.argv[1:]))"]


def make_checkpoint(root: Path, size: int, files: int = 2) -> None:
    import numpy as np

    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(files):
        with open(root / f"model-{i + 1:05d}-of-{files:05d}.safetensors", "wb") as f:
            left = size // files
            while left:
                n = min(left, 64 << 20)
                f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
                left -= n
    (root / "config.json").write_text('{"model_type": "llama"}')


class Run:
    """One publish + N fetches on ``net``; ``go()`` returns the row."""

    def __init__(self, net, env: dict, work: Path, args, mode: str, n: int):
        self.net, self.env, self.work, self.args, self.mode, self.n = net, env, work, args, mode, n
        self.procs: list[subprocess.Popen] = []

    def flags(self, host: int) -> list[str]:
        a = self.args
        return ["--etcd", f"etcd://{self.net.ip(1)}:{ETCD_PORT}/bench", "--host", self.net.ip(host), "--transports",
                "tcp", "--chunk-bytes", a.chunk, "--parallel", str(a.parallel), "--sources", self.mode]  # fmt: skip

    def spawn(self, host: int, argv: list[str]) -> subprocess.Popen:
        cmd = self.net.command(host, [*KVP, "--log-level", self.args.log_level, "p2p", *argv, *self.flags(host)])
        p = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    def go(self) -> dict:
        name = f"{self.mode}-{self.n}"
        pub = self.spawn(2, ["publish", str(self.work / "ckpt"), "--name", name])
        line(pub, "published", 300)
        t0 = time.monotonic()
        recv = [self.spawn(3 + k, ["fetch", name, str(self.work / f"r{k}"), "--serve"]) for k in range(self.n)]
        done, pulls = [], []
        for r in recv:
            text = line(r, "fetched", 3600)
            done.append(time.monotonic() - t0)
            pulls.append(float(re.search(r" in ([0-9.]+) s ", text).group(1)))
            print(f"  {self.mode} N={self.n}: {text.strip()}", file=sys.stderr, flush=True)
        return {"mode": self.mode, "receivers": self.n, "t_all_s": max(done), "slowest_pull_s": max(pulls),
                "verified": self.verify()}  # fmt: skip

    def verify(self) -> bool:
        """Every receiver's files equal the checkpoint's, byte for byte (raises otherwise)."""
        src = sorted(p.relative_to(self.work / "ckpt") for p in (self.work / "ckpt").rglob("*") if p.is_file())
        for k in range(self.n):
            for rel in src:
                if not filecmp.cmp(self.work / "ckpt" / rel, self.work / f"r{k}" / rel, shallow=False):
                    raise RuntimeError(f"receiver {k}'s {rel} differs from the published file")
        return True

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for i, p in enumerate(self.procs):
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if self.args.logs:
                Path(self.args.logs).mkdir(parents=True, exist_ok=True)
                Path(self.args.logs, f"{self.mode}-{self.n}-{'pub' if i == 0 else f'r{i - 1}'}.log").write_text(err)
        for k in range(self.n):
            shutil.rmtree(self.work / f"r{k}", ignore_errors=True)


def line(proc: subprocess.Popen, word: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = proc.stdout.readline()
        if text.startswith(word):
            return text
        if not text and proc.poll() is not None:
            raise RuntimeError(f"a p2p process exited {proc.returncode} before {word!r}: {proc.stderr.read()[-3000:]}")
    raise RuntimeError(f"no {word!r} within {timeout_s} s")


def start_etcd(net, work: Path) -> subprocess.Popen:
    url = f"http://{net.ip(1)}"
    argv = ["etcd", "--name", "h1", "--data-dir", str(work / "etcd"), "--listen-client-urls", f"{url}:{ETCD_PORT}",
            "--advertise-client-urls", f"{url}:{ETCD_PORT}", "--listen-peer-urls", f"{url}:{ETCD_PORT + 1}",
            "--initial-advertise-peer-urls", f"{url}:{ETCD_PORT + 1}", "--initial-cluster", f"h1={url}:{ETCD_PORT + 1}",
            "--logger", "zap", "--log-level", "warn"]  # fmt: skip
    proc = subprocess.Popen(net.command(1, argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        probe = f"import urllib.request; urllib.request.urlopen('{url}:{ETCD_PORT}/health', timeout=2)"
        if net.in_ns(1, sys.executable, "-c", probe, check=False).returncode == 0:
            return proc
        time.sleep(0.2)
    raise RuntimeError("etcd did not become healthy in 30 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--receivers", default="1,2,4,8", help="receiver counts N, comma list")
    ap.add_argument("--modes", default="peers,owner", help="peers (P2P) and/or owner (every receiver from the trainer)")
    ap.add_argument("--rate", default="100mbit", help="each host's link rate, both directions (tc tbf)")
    ap.add_argument("--queue-ms", type=int, default=20, help="each link's drop-tail queue, in ms at its rate")
    ap.add_argument("--size", default="256MiB", help="checkpoint bytes (two safetensors files)")
    ap.add_argument("--chunk", default="4MiB", help="P2P chunk size")
    ap.add_argument("--parallel", type=int, default=4, help="chunks a receiver pulls at once")
    ap.add_argument("--work", default="/dev/shm", help="where the checkpoint and the fetched copies go")
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--log-level", default="WARNING", help="the p2p processes' log level (their stderr: --logs)")
    ap.add_argument("--logs", default="", help="a directory to keep each process's stderr in")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from kvplugins.config import parse_bytes
    from tests.cluster.net import Net

    counts = [int(x) for x in args.receivers.split(",")]
    modes = args.modes.split(",")
    work = Path(tempfile.mkdtemp(prefix="kvp-p2p-bench-", dir=args.work))
    token = work / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**os.environ, "KVPLUGINS_AUTH_TOKEN_FILE": str(token), "PYTHONUNBUFFERED": "1"}
    rows = []
    try:
        make_checkpoint(work / "ckpt", parse_bytes(args.size))
        with Net(2 + max(counts)) as net:
            for i in net.hosts():
                net.shape(i, rate=args.rate, queue_ms=args.queue_ms)
            etcd = start_etcd(net, work)
            try:
                for mode in modes:
                    for n in counts:
                        run = Run(net, env, work, args, mode, n)
                        try:
                            rows.append(run.go())
                        finally:
                            run.stop()
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            finally:
                etcd.kill()
                etcd.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def report(rows: list[dict], args) -> None:
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; checkpoint {args.size}, links {args.rate}, chunks {args.chunk}")
    print(
        "| receivers | "
        + " | ".join(f"{m}: all hold it (s) | {m}: slowest pull (s)" for m in args.modes.split(","))
        + " |"
    )
    print("|---" * (1 + 2 * len(args.modes.split(","))) + "|")
    by = {(r["mode"], r["receivers"]): r for r in rows}
    for n in sorted({r["receivers"] for r in rows}):
        cells = []
        for m in args.modes.split(","):
            r = by.get((m, n))
            cells += [f"{r['t_all_s']:.1f}", f"{r['slowest_pull_s']:.1f}"] if r else ["-", "-"]
        print(f"| {n} | " + " | ".join(cells) + " |")
    for m in args.modes.split(","):
        ts = {n: r["t_all_s"] for (mm, n), r in by.items() if mm == m}
        if len(ts) > 1:
            lo, hi = min(ts), max(ts)
            print(f"{m}: T({hi}) / T({lo}) = {ts[hi] / ts[lo]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
