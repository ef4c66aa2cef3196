"""The master's cost per key of each hot op, decode + validation + logic + reply encoding, with no socket, and
the transfer server's header decode per entry (``wire_req_N``: N entries):
``python benchmarks/master_ops_bench.py [--batch 128] [--rounds 5] [--vs-tree DIR]``.

One request body per op (a slab put (one RPC, into a slab reserved untimed), put_start, put_commit with
checksums, get in the column form, exists, remove) goes
through ``RpcServer._reply_to``, the function the master runs per received frame, as on a connection
authenticated with the client role: get, exists and the slab put are answered by the native front
(native/src/meta/serve.cpp) there. ``--vs-python`` runs this tree with the front and without it (every op the Python way, as before the
front), the same way (new/old < 1: what the front saves). ``--vs-tree DIR`` runs the same
measurement on another checkout (e.g. a ``git worktree`` of the commit before a change) in alternating
subprocesses, so both trees see the same machine state; it prints per-op medians (ns per key) and the ratio
new/old (< 1: the change made the master cheaper). Issue #11 asked this of the typed schemas. ``--vs-events``
runs this tree with the KV event publisher on (master/events.py, each op's events encoded and published) and off,
the same way (on/off > 1: what events cost per key).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Conn:
    """What _reply_to reads of an authenticated raw connection."""

    identity, scan, last_request = "", False, 0.0

    def __init__(self, role: str, front: int):
        self.role, self.front = role, front


def measure(batch: int, iters: int, events: bool = False, front: bool = True) -> dict:
    """ns per key per op, best of ``iters`` passes through a fresh master (this interpreter's kvplugins); with
    ``events`` the master publishes KV events (no subscriber: the PUB socket drops them) and each op's batch is
    encoded and sent in the timed part, as the serving loop does after every request."""
    import msgpack

    from kvplugins.store.config import MasterConfig
    from kvplugins.store.master.metadata import FRONT_EXISTS, FRONT_GET, FRONT_PUT
    from kvplugins.store.master.rpc_server import RpcServer

    size = 1 << 30
    cfg = MasterConfig(metrics_port=-1, events_port=0 if events else -1, admission_probe_ms=0)  # nothing to probe
    server = RpcServer(cfg)
    publish = server.service.events.flush
    conn = _Conn("client", FRONT_GET | FRONT_EXISTS | FRONT_PUT if front else 0)
    wire = {
        "v": 1,
        "segment_id": "bench",
        "host_id": "h",
        "transports": {"tcp": {"host": "127.0.0.1", "port": 1}},
        "regions": [[0, size, None]],
    }
    rid = iter(range(1, 1 << 62))

    node = _Conn("node", 0)
    server._reply_to(node, msgpack.packb([1, next(rid), "register_segment", [[wire, 0, size]], {}]), 0.0)
    best: dict[str, float] = {}
    for it in range(iters):
        keys = [f"bench/{it}/{i:08d}" for i in range(batch)]
        slab = f"bench/{it}/slab/"
        [(code, (sid, _, _, off, *_))] = msgpack.unpackb(  # untimed: the client's slab for its one-RPC puts
            server._reply_to(conn, msgpack.packb([1, next(rid), "reserve", [batch * 4096], {}]), 0.0)
        )[3]
        assert code == 0, f"reserve refused: {sid}"
        steps = [
            ("put", [[f"{slab}{i}", 4096, sid, off + i * 4096] for i in range(batch)], {"xxh3": list(range(batch))}),
            ("put_start", [[k, 4096] for k in keys], {}),
            ("put_commit", keys, {"xxh3": [(i * 0x9E3779B97F4A7C15) % (1 << 64) for i in range(batch)]}),
            ("get", keys, {"cols": 1}),
            ("exists", keys, {}),
            ("remove", keys, {}),
        ]
        for op, entries, opts in steps:
            body = msgpack.packb([1, next(rid), op, entries, opts], use_bin_type=True)
            t0 = time.perf_counter_ns()
            reply = server._reply_to(conn, body, 0.0)
            publish()
            ns = (time.perf_counter_ns() - t0) / batch
            best[op] = min(best.get(op, ns), ns)
            if it == 0 and op == "get":  # the ops did what they are timed for: every key stored and found
                sizes = msgpack.unpackb(reply)[3][1]
                assert sizes == [4096] * batch, f"get answered {sizes[:4]}...: the puts did not store the keys"
        server._reply_to(conn, msgpack.packb([1, next(rid), "remove", [f"{slab}{i}" for i in range(batch)], {}]), 0.0)
        server.service.tick()
    server.close()
    return best | wire_decode()


def wire_decode() -> dict:
    """ns per entry of the transfer TCP server's request header decode (wire.decode_request), 1/32/1024 entries."""
    import timeit

    from kvplugins.transfer import wire

    out = {}
    for n in (1, 32, 1024):
        frame = wire.encode_request(wire.OP_READ, 7, [(1, i * 4096, 4096) for i in range(n)])
        header = frame[wire.PREFIX.size :]
        reps = max(10, 20_000 // n)
        t = min(timeit.repeat(lambda: wire.decode_request(header, 0, 1 << 40), number=reps, repeat=5))
        out[f"wire_req_{n}"] = t / reps / n * 1e9
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128, help="keys per op")
    ap.add_argument("--iters", type=int, default=400, help="batches per round (best per op is kept)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per tree")
    ap.add_argument("--vs-tree", default="", help="another checkout to compare against (old)")
    ap.add_argument("--vs-events", action="store_true", help="this tree with KV events on vs off")
    ap.add_argument("--vs-python", action="store_true", help="this tree with the native front vs without it")
    ap.add_argument("--events", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-front", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        if os.path.abspath(os.environ.get("PYTHONPATH", "")) != HERE:  # another tree: its kvplugins, not the
            sys.meta_path[:] = [f for f in sys.meta_path if "Redirecting" not in type(f).__name__]  # editable one
        print(json.dumps(measure(args.batch, args.iters, args.events, not args.no_front)))
        return
    here = HERE
    if args.vs_events:  # (tree, extra flags) per column; "new"/"old" keep the ratio's meaning: on / off
        trees = {"new": (here, ["--events"]), "old": (here, [])}
    elif args.vs_python:
        trees = {"new": (here, []), "old": (here, ["--no-front"])}
    else:
        trees = {"new": (here, [])} | ({"old": (os.path.abspath(args.vs_tree), [])} if args.vs_tree else {})
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, (tree, flags) in trees.items():
            out = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--child",
                    "--batch",
                    str(args.batch),
                    "--iters",
                    str(args.iters),
                ]
                + flags,
                env={**os.environ, "PYTHONPATH": tree},
                capture_output=True,
                text=True,
                check=True,
                cwd=tree,
            )
            runs[name].append(json.loads(out.stdout))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(
        f"CPU: {cpu}; batch {args.batch} keys; median of {args.rounds} rounds of best-of-{args.iters} "
        "(ns per key or entry)"
        + ("; new = KV events on, old = off" if args.vs_events else "")
        + ("; new = native front, old = every op in Python" if args.vs_python else "")
    )
    print(f"{'op':12} " + " ".join(f"{n:>10}" for n in trees) + ("   new/old" if "old" in trees else ""))
    for op in runs["new"][0]:
        med = {n: statistics.median(r[op] for r in runs[n]) for n in trees}
        ratio = f"   {med['new'] / med['old']:.2f}" if "old" in med else ""
        print(f"{op:12} " + " ".join(f"{med[n]:10.0f}" for n in trees) + ratio)


if __name__ == "__main__":
    main()
