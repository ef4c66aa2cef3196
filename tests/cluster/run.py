"""A fault run of the whole store on a network-namespace cluster (issue #34), a person's command and CI's:

    python -m tests.cluster.run --hosts 6 --minutes 10 --seed 7 [--system mooncake [--mooncake-ha]] [--out DIR]
        [--duration 8]

Makes the hosts (net.py), deploys the store (deploy.py), runs a workload client per engine host (workload.py),
applies the nemesis's seeded schedule (nemesis.py: every fault kind at least once, then random ones until
``--minutes``), stops the clients, reads every acknowledged key back once from a fresh client after the faults
healed, and checks the history offline (checker.py). Prints the verdict table; writes ``DIR/verdict.json``; exits
1 on any wrong byte, unexplained loss, crash or cross-host shared-memory byte. Everything it starts it stops and
every namespace it made it removes (also on Ctrl-C). Needs root, iproute2, nftables, iptables and etcd
(``bash ci/install.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from tests.cluster import checker, history
from tests.cluster.deploy import Deployment
from tests.cluster.nemesis import KINDS, Nemesis, as_dicts
from tests.cluster.net import Net

REPLAY_GRACE_S = 120.0  # how long the trace replay may run past the schedule (its lag) before it is stopped
TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=("kvplugins", "mooncake"), default="kvplugins", help="the store under test")
    p.add_argument(
        "--mooncake-ha",
        action="store_true",
        help="with --system mooncake: Mooncake's HA masters on h2 and h3 electing in etcd (default: one master)",
    )
    p.add_argument("--hosts", type=int, default=6)
    p.add_argument("--minutes", type=float, default=10.0, help="length of the fault schedule")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--duration", type=float, default=8.0, help="seconds each fault holds (>= 2x heartbeat timeout)")
    p.add_argument("--gap", type=float, default=4.0, help="calm seconds between faults")
    p.add_argument("--stop-s", type=float, default=10.0, help="seconds a SIGSTOP holds (60 in long runs)")
    p.add_argument(
        "--kinds",
        default="",
        help=f"the fault kinds to draw from (comma list of {', '.join(KINDS)}); "
        "default: every kind the deployment can suffer",
    )
    p.add_argument(
        "--disk-mib",
        type=int,
        default=0,
        help="give each node a disk tier on a tmpfs of this size (and the disk_full fault); 0 = DRAM only",
    )
    p.add_argument(
        "--shards",
        default="",
        help="sharded masters: comma list of shard ids, e.g. a,b (each an HA pair on h2 and h3; shard z joins and "
        "leaves in the shard_move fault); '' = one HA pair",
    )
    p.add_argument("--out", type=Path, help="where histories and logs go (default: a temp dir)")
    p.add_argument(
        "--trace",
        default=str(TRACE) if TRACE.exists() else "",
        help="also replay this FAST'25 trace through the cluster, its clock scaled to the schedule; '' = "
        "none (kvplugins only; default: ../shared's conversation trace where it exists)",
    )
    p.add_argument("--trace-limit", type=int, default=0, help="replay the trace's first N requests (0 = all)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> checker.Verdict:
    out = args.out or Path(tempfile.mkdtemp(prefix="kvp-cluster-"))
    out.mkdir(parents=True, exist_ok=True)
    with Net(args.hosts) as net:
        d = Deployment(net, out, run=f"r{args.seed}-{int(time.time())}", seed=args.seed, system=args.system,
                       disk_mib=args.disk_mib, shards=tuple(filter(None, args.shards.split(","))),
                       mooncake_ha=args.mooncake_ha)  # fmt: skip
        try:
            d.start()
            nemesis = Nemesis(d, args.seed, args.duration, args.gap, args.stop_s)
            kinds = nemesis.schedule(args.minutes, args.kinds.split(",") if args.kinds else None)
            print(f"cluster up in {out}; {len(kinds)} faults: {' '.join(kinds)}", flush=True)
            replay = _start_replay(d, args, nemesis.seconds(kinds))
            nemesis.run(kinds)
            time.sleep(args.gap)
            d.stop_clients()
            if replay is not None and replay.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):  # then stopped: its exit shows as a crash
                    replay.popen.wait(timeout=REPLAY_GRACE_S)  # it ends itself at the trace's end
            final = _final_read(d, out)
            evictions = _evictions(d)
        finally:
            d.stop()
        verdict = _verdict(d, nemesis, out, final)
        verdict.evictions = evictions
    (out / "verdict.json").write_text(json.dumps({**asdict(verdict), "windows": as_dicts(nemesis.windows)}))
    return verdict


def _start_replay(d: Deployment, args: argparse.Namespace, seconds: float):
    """The trace replay on host 3 (an engine host without a node), its clock sped up so its requests span the
    schedule (on Mooncake, with Mooncake's client as the pool); None without --trace."""
    if not args.trace:
        return None
    from kvplugins.replay import trace

    reqs = trace.load(args.trace, args.trace_limit)
    span_s = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000
    return d.add_replay(3, Path(args.trace), len(reqs), max(span_s / max(seconds, 1.0), 0.001))


def _evictions(d: Deployment) -> int:
    """The store's evictions (the leader's counter; -1 if unknown: Mooncake, or no leader answered)."""
    if d.system != "kvplugins":
        return -1
    code = (
        "from kvplugins.store.client.connect import master_client\n"
        f"try:\n    print(master_client({d.master!r}, 3000).call('status').get('evictions', -1))\n"
        "except Exception:\n    print(-1)"
    )
    out = d.ask(code)
    return int(out) if out.lstrip("-").isdigit() else -1


def _final_read(d: Deployment, out: Path) -> Path:
    """Every acknowledged key read once by a fresh client on host 2 (after every fault healed)."""
    acked = sorted(
        {r.key for r in history.read(sorted(out.glob("client*.jsonl"))) if r.op == "put" and r.result == "ok"}
    )
    keys = out / "acked.json"
    keys.write_text(json.dumps(acked))
    p = d.add_client(2, final=keys, name="final")
    assert p.popen is not None
    p.popen.wait(timeout=300)
    return out / "final.jsonl"


def _verdict(d: Deployment, nemesis: Nemesis, out: Path, final: Path) -> checker.Verdict:
    records = list(history.read(sorted(out.glob("client*.jsonl")) + [final]))
    exits = {}
    for p in d.procs.values():
        codes = [*p.exits, p.popen.returncode if p.popen is not None else 0]
        killed = [i < p.killed for i in range(len(codes))]  # the nemesis's kills end the first `killed` runs
        if p.role == "etcd":  # etcd answers SIGTERM with -15
            codes = [0 if c == -signal.SIGTERM else c for c in codes]
        exits[p.name] = list(zip(codes, killed))
    stats = {}
    for p in d.procs.values():
        f = out / f"{p.name}.stats.json"
        if p.role == "client" and f.exists():
            stats[p.name] = (p.host, json.loads(f.read_text()))
    node_kills = [w.start for w in nemesis.windows if w.kind == "kill_node"]
    v = checker.check(records, nemesis.windows, exits, stats, set(d.node_hosts()), node_kills, nemesis.ring_changes)
    for p in d.procs.values():  # a master whose sweep raises runs on without re-replication or eviction
        failed = p.log.read_text(errors="replace").count("master tick failed") if p.role == "master" else 0
        if failed:
            v.crashes.append(f"{p.name}: its sweep raised ({failed} log lines 'master tick failed'; see {p.log})")
    replay = out / "replay.json"
    if replay.exists():
        v.replay = json.loads(replay.read_text())["results"][0]
    elif any(p.role == "replay" for p in d.procs.values()):
        v.crashes.append("the trace replay wrote no result (its log: replay3.log)")
    return v


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    verdict = run(args)
    print(verdict.table(), flush=True)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
