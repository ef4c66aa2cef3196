"""The nemesis: faults of the kinds real clusters meet, applied to a Deployment on a schedule drawn from a seed.

Each fault picks its target when it starts (``rng`` of the schedule), holds for its duration while the workload
runs, then heals (a killed process is started again, a stopped one continued, a link restored) and is logged as a
``Window`` (kind, targets, hosts it touched, start/end time) for the checker. Kinds:

  isolate_host      one host's link down (every host may be picked: etcd's too)
  cut_master_nodes  the leader master's host and every node host drop each other's packets; clients still reach both
  one_way_drop      a node host stops receiving from the leader master's host (its heartbeats still arrive)
  link_flap         one host's link down and up every second
  delay_200ms       200 ms added to everything one host receives (delay.py: NFQUEUE, no netem on this kernel)
  loss_5pct         5 % of what one host receives dropped at random
  slow_link         one node host's link shaped to 8 Mbit/s
  kill_node         SIGKILL of a store node (restarted: a new, empty segment)
  stop_node         SIGSTOP of a store node (10 s; 60 s in long runs), then SIGCONT
  kill_leader       SIGKILL of the leader master (restarted as a standby)
  stop_leader       SIGSTOP of the leader master (10 s; 60 s in long runs)
  kill_client       SIGKILL of a workload client (restarted, appending to its history)
  stop_client       SIGSTOP of a workload client (10 s)
  disk_full         a node's disk-tier file system filled (a file takes all its free space: offloads get ENOSPC);
                    only in a deployment with disk tiers (``disk_mib``), and drawn only there
  shard_move        a membership change of a sharded deployment (shard z joins, or is removed if it is a member)
                    and, once the ring changed (a joining z first waits for the nodes to hand it extents), SIGKILL
                    of a shard's leader (restarted as a standby); the heal
                    waits for the move to settle (and stops a removed z). Only with ``shards``

With shards, the leader kinds pick the leader of a random shard.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tests.cluster.deploy import SPARE_SHARD, Deployment, Proc

KINDS = (
    "isolate_host",
    "cut_master_nodes",
    "one_way_drop",
    "link_flap",
    "delay_200ms",
    "loss_5pct",
    "slow_link",
    "kill_node",
    "stop_node",
    "kill_leader",
    "stop_leader",
    "kill_client",
    "stop_client",
    "disk_full",
    "shard_move",
)
SETTLE_S = 30.0  # shard_move: how long the heal waits for the move to settle
JOIN_S = 45.0  # shard_move: how long a joining z may take to become a member (nodes hand it extents first)


@dataclass
class Window:
    kind: str
    targets: list[str]
    hosts: list[int]  # the hosts the fault touched (their clients are not "healthy" during it)
    start: float
    end: float = 0.0
    notes: list[str] = field(default_factory=list)


class Nemesis:
    """Runs ``schedule(kinds)`` on ``d``: one fault at a time, ``duration_s`` each (stops: at least ``stop_s``),
    ``gap_s`` of calm between. ``windows``: what was done, for the checker; ``ring_changes``: unix s at which
    each shard_move's new ring epoch was seen (within 0.2 s of the change)."""

    def __init__(self, d: Deployment, seed: int, duration_s: float, gap_s: float, stop_s: float = 10.0):
        self.d, self.rng = d, random.Random(seed)
        self.duration_s, self.gap_s, self.stop_s = duration_s, gap_s, stop_s
        self.windows: list[Window] = []
        self.ring_changes: list[float] = []

    def schedule(self, minutes: float, kinds: list[str] | None = None) -> list[str]:
        """Every kind (of ``kinds``, default all) once in a seeded order, then random ones until ``minutes`` are
        filled. Raises ValueError naming an unknown kind."""
        pool = list(kinds or self.kinds())
        if unknown := set(pool) - set(KINDS):
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
        if missing := set(pool) - set(self.kinds()):
            raise ValueError(
                f"fault kinds {sorted(missing)} need another deployment (disk_full: run.py --disk-mib; shard_move: "
                "--shards)"
            )
        order = list(pool)
        self.rng.shuffle(order)
        per = self.duration_s + self.gap_s
        while len(order) * per < minutes * 60 - per:
            order.append(self.rng.choice(pool))
        return order

    def kinds(self) -> list[str]:
        """The kinds this deployment can suffer (disk_full needs disk tiers, shard_move shards)."""
        needs = {"disk_full": bool(self.d.disk_mib), "shard_move": bool(self.d.shards)}
        return [k for k in KINDS if needs.get(k, True)]

    def seconds(self, kinds: list[str]) -> float:
        """How long ``run(kinds)`` takes (its gaps and holds)."""
        return sum(self.gap_s + self._hold(k) for k in kinds)

    def _hold(self, kind: str) -> float:
        return max(self.duration_s, self.stop_s) if kind.startswith("stop_") else self.duration_s

    def run(self, kinds: list[str], stop: threading.Event | None = None) -> None:
        for kind in kinds:
            if stop is not None and stop.is_set():
                return
            time.sleep(self.gap_s)
            self.apply(kind)

    def apply(self, kind: str) -> Window:
        heal = getattr(self, f"_{kind}")()
        win = self.windows[-1]
        time.sleep(self._hold(kind))
        heal()
        win.end = time.time()
        return win

    # ---- helpers --------------------------------------------------------------------------------------
    def _open(self, kind: str, targets: list[str], hosts: list[int]) -> Window:
        win = Window(kind, targets, hosts, time.time())
        self.windows.append(win)
        return win

    def _pick(self, role: str) -> Proc:
        procs = [p for p in self.d.procs.values() if p.role == role and p.alive()]
        return self.rng.choice(procs)

    def _leader(self) -> Proc:
        leaders = self.d.leaders()
        return self.rng.choice(leaders) if leaders else self._pick("master")

    def _kill(self, kind: str, p: Proc) -> Callable[[], None]:
        self._open(kind, [p.name], [p.host])
        p.killed += 1
        p.signal(signal.SIGKILL)
        return lambda: self.d.spawn(p)

    def _stop(self, kind: str, p: Proc) -> Callable[[], None]:
        self._open(kind, [p.name], [p.host])
        p.stopped = True
        p.signal(signal.SIGSTOP)

        def heal() -> None:
            p.signal(signal.SIGCONT)
            p.stopped = False

        return heal

    def _host(self) -> int:
        return self.rng.choice(list(self.d.net.hosts()))

    # ---- the kinds ------------------------------------------------------------------------------------
    def _isolate_host(self) -> Callable[[], None]:
        return self.isolate(self._host())

    def isolate(self, i: int, kind: str = "isolate_host") -> Callable[[], None]:
        """Cut host i off (logged as ``kind``); returns the heal."""
        self._open(kind, [f"h{i}"], [i])
        self.d.net.cut(i)
        return lambda: self.d.net.heal(i)

    def _cut_master_nodes(self) -> Callable[[], None]:
        m, nodes = self._leader().host, self.d.node_hosts()
        self._open("cut_master_nodes", [f"h{m}<->nodes"], [m, *nodes])
        self.d.net.block(m, nodes)
        return lambda: self.d.net.undrop(m)

    def _one_way_drop(self) -> Callable[[], None]:
        m, i = self._leader().host, self.rng.choice(self.d.node_hosts())
        self._open("one_way_drop", [f"h{i}<-h{m}"], [i])
        self.d.net.drop(i, [m])
        return lambda: self.d.net.undrop(i)

    def _link_flap(self) -> Callable[[], None]:
        i = self._host()
        self._open("link_flap", [f"h{i}"], [i])
        done = threading.Event()

        def flap() -> None:
            while not done.is_set():
                self.d.net.cut(i)
                if done.wait(1.0):
                    break
                self.d.net.heal(i)
                done.wait(1.0)
            self.d.net.heal(i)

        t = threading.Thread(target=flap, daemon=True)
        t.start()

        def heal() -> None:
            done.set()
            t.join()

        return heal

    def _delay_200ms(self) -> Callable[[], None]:
        from tests.cluster.delay import delayed

        i = self._host()
        self._open("delay_200ms", [f"h{i}"], [i])
        ctx = delayed(self.d.net.ns(i), "eth0", 200.0, direction="ingress")  # egress would starve TCP (delay.py)
        ctx.__enter__()
        return lambda: ctx.__exit__(None, None, None)

    def _loss_5pct(self) -> Callable[[], None]:
        i = self._host()
        self._open("loss_5pct", [f"h{i}"], [i])
        self.d.net.shape(i, loss=5)
        return lambda: self.d.net.shape(i, loss=0)

    def _slow_link(self) -> Callable[[], None]:
        i = self.rng.choice(self.d.node_hosts())
        self._open("slow_link", [f"h{i}"], [i])
        self.d.net.shape(i, rate="8mbit")
        return lambda: self.d.net.shape(i, rate="")

    def _kill_node(self) -> Callable[[], None]:
        return self._kill("kill_node", self._pick("node"))

    def _stop_node(self) -> Callable[[], None]:
        return self._stop("stop_node", self._pick("node"))

    def _kill_leader(self) -> Callable[[], None]:
        return self._kill("kill_leader", self._leader())

    def _stop_leader(self) -> Callable[[], None]:
        return self._stop("stop_leader", self._leader())

    def _kill_client(self) -> Callable[[], None]:
        return self._kill("kill_client", self._pick("client"))

    def _stop_client(self) -> Callable[[], None]:
        return self._stop("stop_client", self._pick("client"))

    def _shard_move(self) -> Callable[[], None]:
        d, sid = self.d, SPARE_SHARD
        before = d.ring()
        joining = sid not in before["members"]
        win = self._open("shard_move", [f"{'join' if joining else 'remove'} {sid}"], [])
        try:
            d.add_shard(sid) if joining else d.remove_shard(sid)
        except RuntimeError as e:  # refused (a move not yet swept): the kill below then hits a steady ring
            win.notes.append(str(e))
        deadline = time.monotonic() + (JOIN_S if joining else SETTLE_S)
        while (ring := d.ring())["epoch"] <= before["epoch"] and time.monotonic() < deadline:
            time.sleep(0.2)
        seen = ring["epoch"] > before["epoch"]
        if seen:
            self.ring_changes.append(time.time())  # (seen within a poll of the change: an upper bound)
        win.notes.append(f"ring epoch {before['epoch']} -> {ring['epoch']}, members {ring['members']}")
        victims = [d.procs[f"master{h}{s}"] for s, h in ring["leaders"].items() if h is not None]
        p = self.rng.choice(victims)
        win.targets.append(p.name)
        win.hosts.append(p.host)
        p.killed += 1
        p.signal(signal.SIGKILL)

        def heal() -> None:
            d.spawn(p)
            t0 = time.monotonic()
            while (ring := d.ring())["moving"] and time.monotonic() - t0 < SETTLE_S:
                time.sleep(0.5)
            win.notes.append(f"settled {'in' if not ring['moving'] else 'not within'} {time.monotonic() - t0:.1f} s")
            if ring["epoch"] > before["epoch"] and not seen:
                self.ring_changes.append(time.time())  # the change came only after the wait above
            if not joining and not ring["moving"]:
                d.retire_shard(sid)

        return heal

    def _disk_full(self) -> Callable[[], None]:
        i = self.rng.choice(self.d.node_hosts())
        fs = self.d.disk_dir(i)
        filler = fs / "filler"
        self._open("disk_full", [f"h{i}:{fs.name}"], [i])
        _fill(filler)
        return lambda: filler.unlink()


def _fill(path) -> None:
    """A file at ``path`` taking every free byte of its file system (tmpfs: fallocate takes the pages now, so the
    next write of anyone gets ENOSPC): 1 MiB steps, then halves down to a page."""
    with open(path, "wb") as f:
        off, step = 0, 1 << 20
        while step >= 4096:
            try:
                os.posix_fallocate(f.fileno(), off, step)
                off += step
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                step //= 2


def as_dicts(windows: list[Window]) -> list[dict]:
    return [asdict(w) for w in windows]
