#!/usr/bin/env python3
"""How long a new HA leader takes to rebuild the master's table from etcd (issue #18 part 4).

    .venv/bin/python benchmarks/master_recovery.py [--objects 1000000] [--etcd http://host:port]

Fills a real etcd (started here on loopback, or ``--etcd``) through the leader's own code: a MasterService with
the fenced EtcdJournal (ha/journal.py) takes put_start + put_commit of 64-byte objects with 48-byte keys in
batches of 1,000, each commit one journal batch (group commit, as the leader runs it). Then, in a fresh child
process, what a newly elected leader does (ha/leader.py ``_take_over``): EtcdJournal.load (paged range reads at
one revision, every value decoded and range-checked) and recovery.restore (segments re-added, every object
re-placed in its allocator). Reports journaled puts/s, load and restore seconds, and the child's peak RSS.
Election time (the leader lease, ``--leader-ttl-s``) comes on top of these in a failover.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

PREFIX, LEADER, BATCH = "/kvp-bench", b"bench-leader", 1000


def _service(journal):
    from kvplugins.store.config import MasterConfig
    from kvplugins.store.master.service import MasterService

    return MasterService(MasterConfig(metrics_port=-1, alloc_align=64, heartbeat_timeout_ms=10**9), journal=journal)


def fill(url: str, n: int, key_bytes: int) -> float:
    """Journal ``n`` objects under PREFIX; returns puts/s."""
    from master_scale import keys
    from kvplugins.store.cluster.etcd import Etcd, put_op
    from kvplugins.store.master.ha.journal import EtcdJournal

    etcd = Etcd(url, timeout_s=30)
    journal = EtcdJournal(etcd, PREFIX)
    etcd.txn([], [put_op(journal.leader_key, LEADER)])
    journal.fence = LEADER
    m = _service(journal)
    size = 2 * n * 64  # half full at the end: below the high watermark, so nothing is evicted
    wire = {"v": 1, "segment_id": "s", "host_id": "h", "transports": {}, "regions": [[1, size, None]]}
    m.handle("register_segment", [[wire, 1, size]], {})
    ks = keys(n, key_bytes)
    t0 = time.perf_counter()
    for i in range(0, n, BATCH):
        chunk = ks[i : i + BATCH]
        m.handle("put_start", [[k, 64] for k in chunk], {})
        with journal.batch():
            m.handle("put_commit", chunk, {})
    if len(m.table) != n:
        raise SystemExit(f"the table holds {len(m.table)} of {n} objects (evicted: {m.counters['evictions']})")
    return n / (time.perf_counter() - t0)


def recover(url: str) -> dict:
    """What a new leader does: load the journal and restore a fresh service (in this process)."""
    from master_scale import rss_bytes
    from kvplugins.store.master.ha import recovery
    from kvplugins.store.cluster.etcd import Etcd
    from kvplugins.store.master.ha.journal import EtcdJournal

    journal = EtcdJournal(Etcd(url, timeout_s=60), PREFIX)
    t0 = time.perf_counter()
    segs, objs, slabs = journal.load()
    t1 = time.perf_counter()
    m = _service(journal)
    got = recovery.restore(m, segs, objs, m.clock(), slabs)
    t2 = time.perf_counter()
    peak = rss_bytes(field="VmHWM")
    return {
        "objects": got["objects"],
        "dropped": got["dropped"],
        "load_s": round(t1 - t0, 2),
        "restore_s": round(t2 - t1, 2),
        "peak_rss_mib": round(peak / 2**20),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", default="1000000", help="comma list of object counts")
    ap.add_argument("--key-bytes", type=int, default=48)
    ap.add_argument("--etcd", default="", help="an etcd to use (its PREFIX is overwritten); default: start one")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(recover(a.child)))
        return 0
    from machine import cpu_model

    print(f"CPU: {cpu_model()}; 64-byte objects, {a.key_bytes}-byte keys, one replica\n")
    print("| objects | journaled puts/s | load from etcd s | restore s | recovery total s | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    for n in (int(x) for x in a.objects.split(",")):
        with _etcd(a.etcd) as url:
            rate = fill(url, n, a.key_bytes)
            out = subprocess.run(
                [sys.executable, __file__, "--child", url],
                check=True,
                capture_output=True,
                text=True,
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
            )
            r = json.loads(out.stdout.splitlines()[-1])
            if r["objects"] != n:
                raise SystemExit(f"recovered {r['objects']} of {n} objects ({r['dropped']} dropped)")
            print(
                f"| {n:,} | {rate:,.0f} | {r['load_s']} | {r['restore_s']} | "
                f"{r['load_s'] + r['restore_s']:.2f} | {r['peak_rss_mib']} |",
                flush=True,
            )
    return 0


@contextlib.contextmanager
def _etcd(url: str):
    if url:
        yield url
        return
    from helpers.etcd import etcd_server

    with etcd_server(extra=("--quota-backend-bytes", str(8 << 30))) as etcd:  # 10 M objects pass the 2 GiB default
        yield etcd.url


if __name__ == "__main__":
    sys.exit(main())
