"""Round trip of the master's two RPC endpoints: ``python -m kvplugins.store.rpc_bench [--n 5000]``.

Starts a real ``kvplugins master`` process on 127.0.0.1:0 and times ``exists`` of 1 and of 64 keys (a real
batch op) over the raw framed socket and over zmq DEALER->ROUTER, from this process. Prints p50/p99 in µs.
The numbers in docs/store.md come from this script.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from kvplugins.store.embedded import CLI
from kvplugins.store.client.rpc import RawRpcClient, ZmqRpcClient


def _time(rpc, n: int, batch: int) -> tuple[float, float]:
    keys = [f"key/{i}" for i in range(batch)]
    for _ in range(200):
        rpc.call("exists", keys)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        rpc.call("exists", keys)
        lat.append((time.perf_counter() - t0) * 1e6)
    lat.sort()
    return lat[n // 2], lat[int(n * 0.99)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000, help="timed calls per endpoint")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        port_file = Path(d) / "port"
        proc = subprocess.Popen(CLI + ["--log-level", "WARNING", "master", "--port-file", str(port_file)])
        try:
            while not port_file.exists():
                time.sleep(0.02)
            address = port_file.read_text().strip()
            raw = RawRpcClient(address, 2000)
            zmq_rpc = ZmqRpcClient(raw.call("info")["zmq"], 2000)
            for name, rpc in (("raw framed TCP", raw), ("zmq DEALER/ROUTER", zmq_rpc)):
                for batch in (1, 64):
                    p50, p99 = _time(rpc, args.n, batch)
                    print(f"{name:20s} exists x{batch:<3d} p50 {p50:7.1f} us   p99 {p99:7.1f} us   ({args.n} calls)")
                rpc.close()
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
