#!/usr/bin/env python3
"""What authentication costs per store op (issue #30), measured in one run on a live master, node and client.

Authentication is always on and cannot be turned off, so there is no "auth off" store to time against.
What it adds is known exactly, and each part is timed here beside the ops it is charged to:

* once per connection: the challenge-response handshake of the master's raw RPC endpoint and of the transfer
  core's TCP data connections (security/handshake.py: two HMAC-SHA256 each side, two round trips), timed as
  connect + handshake against a bare TCP connect to the same port;
* once per op: the master checks the connection's role (security/roles.refusal), timed with timeit;
* the optional zmq control plane (rpc="zmq") runs under CURVE, which encrypts every message: a 256 B
  request/reply round trip over loopback, CURVE against plain zmq, both in this process (pyzmq/libsodium).

Op latencies (median) in the same run: one 4 KiB put and get, a batch of 32 x 1 MiB put and get (the bytes
API, shm transport, one host; the store started as store_bench.py starts it: a master and one 1 GiB node). Reported: each auth cost as a share of the op, on a kept connection (how every
kvplugins client runs: one connection per client, for its lifetime) and, as an upper bound, if a client
opened a new connection for every op.

  .venv/bin/python benchmarks/auth_cost.py [--iters 200] [--json .bench/auth.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from storebench import clusters  # noqa: E402  (our store as store_bench.py starts it: master + one node)
from machine import cpu_model


def median_us(fn, iters: int) -> float:
    xs = []
    for i in range(iters):
        t = time.perf_counter()
        fn(i)
        xs.append(time.perf_counter() - t)
    return statistics.median(xs) * 1e6


def op_latencies(cfg: dict, iters: int) -> dict[str, float]:
    from kvplugins.store.client import StoreClient
    from kvplugins.store.config import ClientConfig

    client = StoreClient(ClientConfig(**cfg))
    small, big = os.urandom(4096), [os.urandom(1 << 20) for _ in range(32)]
    try:
        out = {
            "put_4KiB_us": median_us(lambda i: client.put(f"s{i}", small), iters),
            "get_4KiB_us": median_us(lambda i: _same(client.get(f"s{i}"), small), iters),
        }
        puts, gets = [], []
        # each batch is removed after its get; its bytes return when its readers' leases end (~1 s)
        for i in range(max(10, iters // 10)):
            keys = [f"b{i}/{j}" for j in range(32)]
            t = time.perf_counter()
            _ok(client.batch_put(keys, big))
            puts.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = client.batch_get(keys)
            gets.append(time.perf_counter() - t)
            _ok(got)
            assert list(got) == big, "a get returned other bytes"
            client.batch_remove(keys)
        out["put_1MiBx32_us"], out["get_1MiBx32_us"] = (statistics.median(x) * 1e6 for x in (puts, gets))
        return out
    finally:
        client.close()


def _same(got: bytes, want: bytes) -> None:
    if got != want:
        raise RuntimeError("a get returned other bytes than its put")


def _ok(results: list) -> None:
    bad = [r for r in results if isinstance(r, Exception)]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(results)} failed: {bad[0]!r}")


def handshake_us(master: str, iters: int) -> dict[str, float]:
    """Median connect + authenticate (client role) to the master's raw endpoint, and a bare connect."""
    from kvplugins import security
    from kvplugins.security import handshake

    secret = security.resolve()
    host, port = master.rsplit(":", 1)

    def bare(_):
        socket.create_connection((host, int(port)), timeout=5).close()

    def authed(_):
        s = socket.create_connection((host, int(port)), timeout=5)
        handshake.client(s, secret, time.monotonic() + 5, f"master {master}", role="client")
        s.close()

    return {"connect_us": median_us(bare, iters), "connect_auth_us": median_us(authed, iters)}


def role_check_ns() -> float:
    from kvplugins.security import roles

    n = 200_000
    return min(timeit.repeat(lambda: roles.refusal("get", "client"), number=n, repeat=5)) / n * 1e9


def zmq_rtt_us(iters: int) -> dict[str, float]:
    """256 B request/reply over loopback: plain zmq and CURVE (keys made here)."""
    import zmq

    out = {}
    for curve in (False, True):
        ctx = zmq.Context()
        srv, cli = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        if curve:
            spub, ssec = zmq.curve_keypair()
            cpub, csec = zmq.curve_keypair()
            srv.curve_secretkey, srv.curve_publickey, srv.curve_server = ssec, spub, True
            cli.curve_secretkey, cli.curve_publickey, cli.curve_serverkey = csec, cpub, spub
        port = srv.bind_to_random_port("tcp://127.0.0.1")
        cli.connect(f"tcp://127.0.0.1:{port}")
        stop = threading.Event()

        def echo():
            while not stop.is_set():
                if srv.poll(100):
                    srv.send_multipart(srv.recv_multipart())

        t = threading.Thread(target=echo)
        t.start()
        msg = os.urandom(256)

        def rtt(_):
            cli.send(msg)
            assert cli.recv() == msg

        rtt(0)  # the handshake
        out["zmq_curve_rtt_us" if curve else "zmq_plain_rtt_us"] = median_us(rtt, iters)
        stop.set()
        t.join()
        srv.close(0)
        cli.close(0)
        ctx.term()
    return out


def report(r: dict) -> str:
    hs = r["connect_auth_us"] - r["connect_us"]
    check = r["role_check_ns"] / 1000
    rows = [
        ("one 4 KiB put", r["put_4KiB_us"]),
        ("one 4 KiB get", r["get_4KiB_us"]),
        ("32 x 1 MiB put", r["put_1MiBx32_us"]),
        ("32 x 1 MiB get", r["get_1MiBx32_us"]),
    ]
    lines = [
        f"CPU: {r['cpu']}; {r['iters']} iterations; medians",
        f"handshake: connect + authenticate {r['connect_auth_us']:.0f} us, bare connect {r['connect_us']:.0f} us "
        f"-> {hs:.0f} us once per connection; role check {r['role_check_ns']:.0f} ns per op",
        f"zmq control plane, 256 B round trip: plain {r['zmq_plain_rtt_us']:.0f} us, CURVE "
        f"{r['zmq_curve_rtt_us']:.0f} us",
        "",
        "| op | median | auth share, kept connection | auth share, a new connection per op |",
        "|---|---|---|---|",
    ]
    for name, us in rows:
        lines.append(f"| {name} | {us:.0f} us | {100 * check / us:.4f}% | {100 * (hs + check) / us:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200, help="timed repetitions per figure (median)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvp-auth-") as d, clusters.kvp("shm", 256 << 20, Path(d)) as target:
        master = target.cfg["master"]
        r = {
            "cpu": cpu_model(),
            "iters": args.iters,
            **op_latencies(target.cfg, args.iters),
            **handshake_us(master, args.iters),
            "role_check_ns": role_check_ns(),
            **zmq_rtt_us(args.iters),
        }
    print(report(r))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
