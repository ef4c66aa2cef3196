#!/usr/bin/env python3
"""Sharded masters against one master, over the real RPC path (issue #18 part 4): RSS per object and batched
key-ops/s, and the time clients need to route around a shard's dead master.

    .venv/bin/python benchmarks/master_shards.py [--objects 10000000,40000000] [--shards 1,4] [--failover]

Per (masters, objects) pair: a real etcd and that many ``kvplugins master`` processes on loopback (1 = a plain
master reached with RawRpcClient; more = ``--cluster shards://... --shard sI``, reached with the sharded
client, kvplugins/store/client/router.py, which sends each batch's keys to their shards in parallel). Each master
gets one segment registered by RPC that never carries bytes (this measures the masters and the routing, not
transfers: ``put_start`` + ``put_commit`` per batch of 1,000 64-byte objects with 48-byte keys, as
master_scale.py makes them). Then ``exists`` and ``get`` batches of 1,000 random stored keys (best of 3 passes
of 20 batches). Reports objects per master, RSS growth per object (summed over the masters), puts/s and
key-ops/s as one client sees them.

``--failover``: 3 shards, s0 an HA pair; 20,000 objects; SIGKILL s0's leader, then time until a get of s0's
keys answers again, and check the other shards' gets meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from master_scale import rss_bytes  # noqa: E402

BATCH, SIZE, PREFIX = 1000, 64, "llama3-8b/bf16/tp0/"


def key(i: int, key_bytes: int = 48) -> str:
    width = max(16, key_bytes - len(PREFIX))
    return PREFIX + f"{i * 0x9E3779B97F4A7C15 & (1 << 64) - 1:0{width}x}"[-width:]


@contextlib.contextmanager
def masters(n_shards: int, per_shard_bytes: int, tmp: Path, ha_first: bool = False):
    """Yields (client address, {shard: [Popen]}, etcd url)."""
    from tests.helpers.cluster import _env, _spawn, _wait_file
    from tests.helpers.etcd import etcd_server
    from kvplugins.store.cluster.membership import Membership

    with etcd_server() as etcd:
        cluster = "shards://" + etcd.url.removeprefix("http://") + "/bench"
        procs: dict = {}
        try:
            for i in range(n_shards):
                for j in range(2 if ha_first and i == 0 else 1):
                    flags = [
                        "--heartbeat-timeout-ms",
                        str(10**9),
                        "--lease-ttl-ms",
                        "1000",
                        "--admission-probe-ms",
                        "0",
                    ]  # byte-less segments
                    if n_shards > 1 or ha_first:
                        flags += ["--cluster", cluster, "--shard", f"s{i}", "--shard-move-window-ms", "0"]
                    if ha_first and i == 0:
                        flags += ["--etcd", etcd.url]
                    pf = tmp / f"m{i}-{j}.port"
                    p = _spawn(
                        ["master", "--port", "0", "--port-file", str(pf)] + flags, tmp / f"m{i}-{j}.log", _env(tmp)
                    )
                    p.address = _wait_file(p, pf, f"master s{i}")
                    procs.setdefault(f"s{i}", []).append(p)
                if n_shards > 1 or ha_first:
                    _wait(
                        lambda: (
                            f"s{i}" in Membership(cluster).read().members and not Membership(cluster).read().unswept()
                        )
                    )
            address = cluster if n_shards > 1 or ha_first else procs["s0"][0].address
            _register(address, per_shard_bytes)
            yield address, procs, etcd.url
        finally:
            for ps in procs.values():
                for p in ps:
                    p.kill()


def _wait(check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for the shards to join")
        time.sleep(0.1)


def _register(address: str, size: int) -> None:
    """One byte-less segment of ``size`` per master (registered by RPC; never heart-beats: timeout 10^9 ms)."""
    import secrets

    from kvplugins.security import resolve
    from kvplugins.security.secret import owner_proof
    from kvplugins.store.client.connect import master_client
    from kvplugins.store.cluster.membership import Membership

    addrs = Membership(address).read().members if address.startswith("shards://") else {"s0": address}
    for sid, addr in addrs.items():
        rpc = master_client(addr, 10_000, "node")  # registering a segment is a node's op
        wire = {"v": 1, "segment_id": f"bench-{sid}", "host_id": "h", "transports": {}, "regions": [[1, size, None]]}
        owner = secrets.token_hex(32)
        opts = {"owner": owner, **owner_proof(resolve(), owner)}
        [(code, why)] = rpc.call("register_segment", [[wire, 1, size]], opts)
        rpc.close()
        if code != 0:
            raise SystemExit(f"segment refused by {sid}: {why}")


def measure(n_shards: int, n: int, key_bytes: int) -> dict:
    from kvplugins.store.client.connect import master_client

    per_shard = int(2 * n * SIZE / n_shards * 1.3) + (1 << 20)  # the largest share + slack: nothing evicted
    with (
        tempfile.TemporaryDirectory(prefix="kvp-shards-bench-") as d,
        masters(n_shards, per_shard, Path(d)) as (address, procs, _),
    ):
        pids = [ps[0].popen.pid for ps in procs.values()]
        rpc = master_client(address, 60_000)
        before = sum(rss_bytes(p) for p in pids)
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            ks = [key(j, key_bytes) for j in range(i, min(n, i + BATCH))]
            started = rpc.call("put_start", [[k, SIZE] for k in ks])
            if any(code != 0 for code, _ in started):
                raise SystemExit(f"put_start refused: {next(v for c, v in started if c != 0)}")
            rpc.call("put_commit", ks)
        put_s = time.perf_counter() - t0
        time.sleep(1.0)
        grown = sum(rss_bytes(p) for p in pids) - before
        counts = _counts(address)
        if sum(counts.values()) != n:
            raise SystemExit(f"the masters hold {sum(counts.values())} of {n} objects")
        rng = random.Random(1)
        rates = {op: _best(rpc, op, n, key_bytes, rng) for op in ("exists", "get")}
        rpc.close()
    return {
        "masters": n_shards,
        "objects": n,
        "per_master": counts,
        "bytes_per_object": round(grown / n),
        "rss_mib": round((before + grown) / 2**20),
        "puts_per_s": round(n / put_s),
        **rates,
    }


def _best(rpc, op: str, n: int, key_bytes: int, rng) -> int:
    best = 0.0
    for _ in range(3):
        batches = [[key(rng.randrange(n), key_bytes) for _ in range(BATCH)] for _ in range(20)]
        t0 = time.perf_counter()
        for ks in batches:
            out = rpc.call(op, ks)
            if op == "exists" and not all(out):
                raise SystemExit("a stored key answered not found")
        best = max(best, 20 * BATCH / (time.perf_counter() - t0))
    return round(best)


def _counts(address: str) -> dict:
    from kvplugins.store.client.connect import master_client
    from kvplugins.store.cluster.membership import Membership

    addrs = Membership(address).read().members if address.startswith("shards://") else {"s0": address}
    out = {}
    for sid, addr in sorted(addrs.items()):
        rpc = master_client(addr, 60_000)
        out[sid] = rpc.call("status")["objects"]
        rpc.close()
    return out


def failover(n: int = 20_000) -> dict:
    """3 shards, s0 an HA pair: seconds from SIGKILL of s0's leader until s0's keys read again."""
    from kvplugins.store.client.connect import master_client
    from kvplugins.store.cluster.membership import Membership
    from tests.helpers.shards import leads

    with (
        tempfile.TemporaryDirectory(prefix="kvp-shards-fo-") as d,
        masters(3, 4 * n * SIZE, Path(d), ha_first=True) as (address, procs, _),
    ):
        rpc = master_client(address, 10_000)
        ks = [key(j) for j in range(n)]
        for i in range(0, n, BATCH):
            rpc.call("put_start", [[k, SIZE] for k in ks[i : i + BATCH]])
            rpc.call("put_commit", ks[i : i + BATCH])
        ring = Membership(address).read().ring
        mine = [k for k in ks if ring.owner(k) == "s0"][:BATCH]
        others = [k for k in ks if ring.owner(k) != "s0"][:BATCH]

        leader = next(p for p in procs["s0"] if leads(p.address))
        leader.kill()
        t0, other_worst, other_ok = time.monotonic(), 0.0, True
        while True:
            t1 = time.monotonic()
            other_ok &= all(rpc.call("exists", others))
            other_worst = max(other_worst, time.monotonic() - t1)
            if all(rpc.call("exists", mine)):
                break
            if time.monotonic() - t0 > 60:
                raise SystemExit("s0's keys did not come back within 60 s")
        back = time.monotonic() - t0
        rpc.close()
    return {
        "routed_around_s": round(back, 2),
        "others_all_found": other_ok,
        "others_worst_batch_ms": round(other_worst * 1000, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", default="10000000,40000000", help="objects per run, comma list (paired with --shards)")
    ap.add_argument("--shards", default="1,4", help="masters per run, comma list (1 = one plain master)")
    ap.add_argument("--key-bytes", type=int, default=48)
    ap.add_argument("--failover", action="store_true", help="also time routing around a dead shard master")
    a = ap.parse_args(argv)
    from machine import cpu_model

    runs = list(zip([int(s) for s in a.shards.split(",")], [int(n) for n in a.objects.split(",")]))
    print(f"CPU: {cpu_model()}; {SIZE}-byte objects, {a.key_bytes}-byte keys, batches of {BATCH}, over RPC\n")
    print(
        "| masters | objects | per master | RSS growth per object (bytes) | masters' RSS MiB | puts/s | "
        "exists key-ops/s | get key-ops/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for shards, n in runs:
        r = measure(shards, n, a.key_bytes)
        per = " / ".join(f"{v:,}" for v in r["per_master"].values())
        print(
            f"| {shards} | {n:,} | {per} | {r['bytes_per_object']} | {r['rss_mib']:,} | {r['puts_per_s']:,} | "
            f"{r['exists']:,} | {r['get']:,} |",
            flush=True,
        )
    if a.failover:
        print(f"\nfailover: {failover()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
