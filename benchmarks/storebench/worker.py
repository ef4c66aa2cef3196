"""A benchmark worker process: ``python -m storebench.worker --backend B --role writer|reader|segment``.

Reads one JSON command per line on stdin and answers one JSON line on the original stdout (fd 1 is moved to
stderr first, so native libraries that print cannot corrupt the protocol). Commands:
  {"op": "put", "keys": [...], "size": S, "round": R}  stamp, checksum, then time one put call -> {"t", "sums"}
  {"op": "get", "keys": [...], "size": S}              zero, time one get call, checksum -> {"t", "sums"}
  {"op": "remove", "keys": [...]}, {"op": "stats"}, {"op": "exit"}
Any failure answers {"error": "..."}; the driver stops the run (speed never hides a failed op).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

from storebench.clients import open_client
from storebench.workload import checksums, fill_random, stamp


def _handle(client, buf, cmd: dict) -> dict:
    op = cmd["op"]
    if op in ("put", "get"):
        keys, size = cmd["keys"], cmd["size"]
        if op == "put":
            stamp(buf, size, len(keys), cmd["round"])
            sums = checksums(buf, size, len(keys))
        else:
            buf[: size * len(keys)] = 0
        call = client.bind(op, keys, size)
        t0 = time.perf_counter()
        call()
        dt = time.perf_counter() - t0
        return {"t": dt, "sums": sums if op == "put" else checksums(buf, size, len(keys))}
    if op == "remove":
        client.remove(cmd["keys"])
        return {}
    if op == "stats":
        return {"stats": json.loads(json.dumps(client.stats(), default=str))}
    raise ValueError(f"unknown command {op!r}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--role", choices=("writer", "reader", "segment"), required=True)
    p.add_argument("--config", required=True, help="JSON: addresses of the store's servers")
    p.add_argument("--buffer-bytes", type=int, default=0)
    p.add_argument("--segment-bytes", type=int, default=0)
    args = p.parse_args()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    try:
        buf = np.zeros(args.buffer_bytes, dtype=np.uint8) if args.role != "segment" else None
        if args.role == "writer":
            fill_random(buf, seed=12345)
        client = open_client(args.backend, json.loads(args.config), buf, args.segment_bytes)
    except Exception as e:  # noqa: BLE001 - reported to the driver, which stops the run
        traceback.print_exc()
        reply({"error": f"setup: {type(e).__name__}: {e}"})
        return 1
    reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            reply(_handle(client, buf, cmd))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            reply({"error": f"{cmd['op']}: {type(e).__name__}: {e}"})
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
