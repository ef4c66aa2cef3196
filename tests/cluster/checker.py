"""The offline checker of a cluster run: reads every client's history (history.py), the nemesis's windows, each
process's exits and each client's transfer counters, and gives a verdict table.

Checks (issue #34):
1. wrong bytes: a get or final_get answered bytes whose digest is not that of the key's one value. Must be 0.
2. acknowledged objects lost: a key with an acknowledged put that the after-the-heal read (final_get) misses or
   fails. Explained when at least ``replicas`` store nodes were SIGKILLed after the put (every replica may have
   been on them, faster than re-replication could copy it), or the shard ring changed after MAX_VIEW_AGE_S before
   the put began (a move costs misses by design: a key is not copied to its new shard and objects on moved extents
   go, docs/operations.md *Sharded masters*; a master routes a put by a ring read at most MAX_VIEW_AGE_S before,
   master/shard.py); otherwise unexplained, and the run fails.
3. unavailability per fault kind: for each window, the longest stretch in which a healthy client (not on a host the
   fault touched, not itself the target) saw its operations fail: from the first failing op's start to the end of
   the next op that succeeded (or the window's end plus the recovery allowance); and its slowest single operation
   (a stall that ends in success is no failure, but shows there). Lost objects are also counted per kind of fault
   that ran after they were acknowledged (one loss may count under several kinds).
4. crashes: a process that exited non-zero (or by a signal) that the nemesis did not send; run.py adds a master
   whose periodic sweep raised (its log says "master tick failed").
5. no byte between hosts by shared memory or the same-host read: clients on hosts without a node moved 0 bytes over
   shm and cma (a host-id mistake would make every link fault bite nothing).
6. the trace replay (kvplugins replay of the FAST'25 trace through the cluster, run.py): every request served,
   no wrong byte (its own check of every byte it reads).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cache

from kvplugins.store.master.shard import MAX_VIEW_AGE_S
from tests.cluster.history import Record, digest_of, value_of
from tests.cluster.nemesis import Window

FAILED = "error"


@cache
def expected(key: str) -> str:
    return digest_of(value_of(key))


@dataclass
class KindRow:
    kind: str
    faults: int = 0
    ops: int = 0  # operations (per key) that started during its windows
    failed: int = 0
    max_unavailable_s: float = 0.0
    max_latency_s: float = 0.0  # the slowest single operation of a healthy client (a hang shows here)
    lost_after: int = 0  # lost acknowledged objects acknowledged before one of its windows


@dataclass
class Verdict:
    ops: int = 0
    wrong_bytes: list[str] = field(default_factory=list)
    acknowledged: int = 0
    lost_unexplained: list[str] = field(default_factory=list)
    lost_explained: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    cross_host: list[str] = field(default_factory=list)
    kinds: dict[str, KindRow] = field(default_factory=dict)
    replay: dict = field(default_factory=dict)  # the trace replay's result row (kvplugins.replay.report.row)
    evictions: int = -1  # the store's evictions at the end (-1: unknown): each may be a loss the checker counts

    @property
    def ok(self) -> bool:
        bad_replay = self.replay.get("wrong_bytes", 0) != 0
        return not (self.wrong_bytes or self.lost_unexplained or self.crashes or self.cross_host or bad_replay)

    def table(self) -> str:
        lines = [
            "| fault | n | ops during | failed | max unavailable (s) | slowest op (s) | lost acked before it |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sorted(self.kinds.values(), key=lambda r: r.kind):
            lines.append(
                f"| {r.kind} | {r.faults} | {r.ops} | {r.failed} | {r.max_unavailable_s:.1f} | "
                f"{r.max_latency_s:.1f} | {r.lost_after} |"
            )
        lines += [
            "",
            f"ops {self.ops}; wrong bytes {len(self.wrong_bytes)}; acknowledged objects {self.acknowledged}, lost "
            f"{len(self.lost_unexplained)} unexplained + {len(self.lost_explained)} explained (>= replicas nodes "
            f"killed, or a shard move, after the put); crashes {len(self.crashes)}; shm/cma bytes between hosts "
            f"{len(self.cross_host)} clients; store evictions (sweep picks, offloads included) "
            f"{self.evictions if self.evictions >= 0 else 'unknown'}",
        ]
        if r := self.replay:
            lines.append(
                f"trace replay: {r['requests']} requests, {r['blocks']} blocks, hit ratio {r['hit_ratio']:.3f}, "
                f"{r['store_errors']} requests served as misses on a store error, {r['put_failures']} of "
                f"{r['puts']} puts failed, {r['get_misses']} of {r['gets']} hit reads missed, wrong bytes "
                f"{r['wrong_bytes']}"
            )
        for name, items in (("wrong", self.wrong_bytes), ("lost", self.lost_unexplained), ("crash", self.crashes),
                            ("cross-host", self.cross_host)):  # fmt: skip
            lines += [f"  {name}: {x}" for x in items[:10]]
        return "\n".join(lines)


def check(
    records: list[Record],
    windows: list[Window],
    exits: dict[str, list[tuple[int, bool]]],
    stats: dict[str, dict],
    node_hosts: set[int],
    node_kills: list[float],
    moves: list[float] = (),
    replicas: int = 2,
    recovery_s: float = 5.0,
) -> Verdict:
    """``exits``: per process, (return code, killed by the nemesis) of each incarnation; ``stats``: per client
    name, (host, transfer_stats); ``node_kills``: times of the nemesis's SIGKILLs of store nodes; ``moves``: unix s
    times of shard membership changes."""
    v = Verdict(ops=len(records))
    _wrong_bytes(v, records)
    _unavailability(v, records, windows, recovery_s)
    _losses(v, records, windows, node_kills, list(moves), replicas)
    for name, runs in exits.items():
        v.crashes += [f"{name} exited {code}" for code, by_nemesis in runs if code != 0 and not by_nemesis]
    for client, (host, st) in stats.items():
        moved = sum(st.get(t, {}).get("bytes", 0) for t in ("shm", "cma"))
        if host not in node_hosts and moved:
            v.cross_host.append(f"{client} on h{host}: {moved} bytes over shm/cma")
    return v


def _wrong_bytes(v: Verdict, records: list[Record]) -> None:
    for r in records:
        if r.op in ("get", "final_get") and r.result == "ok" and r.digest != expected(r.key):
            v.wrong_bytes.append(f"{r.client} {r.op} {r.key} at {r.t0:.3f}")


def _losses(
    v: Verdict, records: list[Record], windows: list[Window], node_kills: list[float], moves: list[float], replicas: int
) -> None:
    acked: dict[str, tuple[float, float]] = {}  # key -> (start, ack) of its first acknowledged put
    for r in records:
        if r.op == "put" and r.result == "ok":
            acked.setdefault(r.key, (r.t0, r.t1))
    v.acknowledged = len(acked)
    final = {r.key: r for r in records if r.op == "final_get"}
    for key, (t0, t) in acked.items():
        r = final.get(key)
        if r is not None and r.result == "ok":
            continue
        why = f"{key} (final: {r.result if r else 'not read'}{': ' + str(r.error)[:80] if r and r.error else ''})"
        kills_after = sum(1 for k in node_kills if k >= t - 1.0)
        moved = any(m >= t0 - MAX_VIEW_AGE_S for m in moves)
        (v.lost_explained if kills_after >= replicas or moved else v.lost_unexplained).append(why)
        for kind in {w.kind for w in windows if w.end >= t}:
            v.kinds[kind].lost_after += 1


def _unavailability(v: Verdict, records: list[Record], windows: list[Window], recovery_s: float) -> None:
    by_client: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        if r.op != "final_get":
            by_client[r.client].append(r)
    for ops in by_client.values():
        ops.sort(key=lambda r: r.t0)
    for w in windows:
        row = v.kinds.setdefault(w.kind, KindRow(w.kind))
        row.faults += 1
        for client, ops in by_client.items():
            if int(ops[0].host.lstrip("h")) in w.hosts or client in w.targets:
                continue
            during = [r for r in ops if w.start <= r.t0 <= w.end + recovery_s]
            row.ops += len(during)
            row.failed += sum(r.result == FAILED for r in during)
            row.max_latency_s = max([row.max_latency_s, *(r.t1 - r.t0 for r in during)])
            row.max_unavailable_s = max(row.max_unavailable_s, _longest_outage(during, w.end + recovery_s))


def _longest_outage(ops: list[Record], limit: float) -> float:
    longest, since = 0.0, None
    for r in ops:
        if r.result == FAILED:
            since = r.t0 if since is None else since
        elif since is not None:
            longest, since = max(longest, r.t1 - since), None
    if since is not None:
        longest = max(longest, limit - since)
    return longest
