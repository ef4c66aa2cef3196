#!/usr/bin/env python3
"""Master HA benchmark (issue #6): what the etcd journal costs a put, and how group commit shares etcd writes.

Starts a real etcd (Debian etcd-server; `bash ci/install.sh`), one `kvplugins master --etcd` and one
`kvplugins store` as processes, then runs ``--clients`` StoreClients in threads of this process, each putting
``--puts`` objects of ``--size`` bytes one at a time. It reports puts/s, the p50/p99 put latency, and the
etcd write requests per put: etcd's ``etcd_server_proposals_committed_total``, which group commit brings
below 1 when several clients commit in the same loop turn of the master. Then one client reads every object
back with ``get_into`` one at a time (p50/p99: gets never touch etcd) and compares it. The same run against a
plain master (no etcd) is the baseline.

  .venv/bin/python benchmarks/ha_bench.py --clients 8 --puts 50
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from kvplugins.config import parse_bytes
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.embedded import CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (threads)")
    p.add_argument("--puts", type=int, default=50, help="puts per client")
    p.add_argument("--size", default="4KiB", help="object size")
    return p.parse_args(argv)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, ready, proc: subprocess.Popen, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            value = ready()
            if value:
                return value
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready after {timeout_s} s")


@contextlib.contextmanager
def _processes(tmp: Path, etcd: bool):
    """Yields (master address for clients, etcd URL or ''); kills everything on exit."""
    procs, url = [], ""
    try:
        master_flags = []
        if etcd:
            binary = shutil.which("etcd") or "/usr/bin/etcd"
            client, peer = _port(), _port()
            url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
            procs.append(
                subprocess.Popen(
                    [
                        binary,
                        "--name",
                        "b",
                        "--data-dir",
                        str(tmp / "etcd"),
                        "--listen-client-urls",
                        url,
                        "--advertise-client-urls",
                        url,
                        "--listen-peer-urls",
                        peer_url,
                        "--initial-advertise-peer-urls",
                        peer_url,
                        "--initial-cluster",
                        f"b={peer_url}",
                        "--log-level",
                        "warn",
                        "--logger",
                        "zap",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            _wait("etcd", lambda: b"true" in urllib.request.urlopen(url + "/health", timeout=1).read(), procs[-1])
            master_flags = ["--etcd", url, "--etcd-prefix", "/bench"]
        port_file = tmp / "master.port"
        procs.append(
            subprocess.Popen(
                CLI + ["master", "--port-file", str(port_file)] + master_flags,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        raw = _wait("master", lambda: port_file.read_text().strip(), procs[-1])
        address = f"etcd://{url.removeprefix('http://')}/bench" if etcd else raw
        ready = tmp / "node.ready"
        procs.append(
            subprocess.Popen(
                CLI + ["store", "--master", address, "--segment-size", "256MiB", "--ready-file", str(ready)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _wait("store node", lambda: ready.read_text().strip(), procs[-1])
        yield address, url
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()


def _proposals(url: str) -> int:
    if not url:
        return 0
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return int(float(re.search(r"^etcd_server_proposals_committed_total (\S+)", text, re.M).group(1)))


def run(address: str, url: str, args, size: int) -> dict:
    clients = [StoreClient(ClientConfig(master=address)) for _ in range(args.clients)]
    lat: list[float] = []
    data = {f"c{j}-{i}": bytes([j % 256, i % 256]) * (size // 2) for j in range(args.clients) for i in range(args.puts)}

    def work(j: int) -> None:
        for i in range(args.puts):
            key = f"c{j}-{i}"
            t = time.perf_counter()
            clients[j].put(key, data[key])
            lat.append(time.perf_counter() - t)

    before, t0 = _proposals(url), time.perf_counter()
    threads = [threading.Thread(target=work, args=(j,)) for j in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, writes = time.perf_counter() - t0, _proposals(url) - before
    wrong = [k for k, v in zip(data, clients[0].batch_get(list(data))) if v != data[k]]
    gets = _get_into(clients[0], data, size, wrong)
    for c in clients:
        c.close()
    lat.sort()
    return {
        "puts_per_s": round(len(data) / elapsed),
        "put_p50_us": round(statistics.median(lat) * 1e6),
        "put_p99_us": round(lat[int(len(lat) * 0.99) - 1] * 1e6),
        "etcd_writes_per_put": round(writes / len(data), 2) if url else None,
        "get_into_p50_us": round(statistics.median(gets) * 1e6),
        "get_into_p99_us": round(gets[int(len(gets) * 0.99) - 1] * 1e6),
        "wrong_or_lost": len(wrong),
    }


def _get_into(client: StoreClient, data: dict, size: int, wrong: list) -> list[float]:
    """Seconds per ``get_into`` of every key, one at a time into a registered buffer (gets never touch etcd: this
    is the master's read path, native on a plain master and on an HA leader alike), sorted; a key read back
    different goes to ``wrong``."""
    import numpy as np

    buf = np.zeros(size, dtype=np.uint8)
    client.register_buffer(buf)
    out = []
    for key, value in data.items():
        t = time.perf_counter()
        client.get_into(key, [(buf.ctypes.data, size)])
        out.append(time.perf_counter() - t)
        if buf.tobytes() != value:
            wrong.append(key)
    return sorted(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    size = parse_bytes(args.size)
    out = {"clients": args.clients, "puts_per_client": args.puts, "size": size}
    for name, etcd in (("plain", False), ("ha", True)):
        with tempfile.TemporaryDirectory(prefix="kvp-ha-bench-") as d, _processes(Path(d), etcd) as (addr, url):
            out[name] = run(addr, url, args, size)
    print(json.dumps(out, indent=1))
    return 1 if out["plain"]["wrong_or_lost"] or out["ha"]["wrong_or_lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
