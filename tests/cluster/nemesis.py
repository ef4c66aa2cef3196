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

Not yet: a node's disk tier full, a shard leader killed during a membership change (the deployment has neither a
disk tier nor shards yet: issue #34).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tests.cluster.deploy import Deployment, Proc

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
)


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
    ``gap_s`` of calm between. ``windows``: what was done, for the checker."""

    def __init__(self, d: Deployment, seed: int, duration_s: float, gap_s: float, stop_s: float = 10.0):
        self.d, self.rng = d, random.Random(seed)
        self.duration_s, self.gap_s, self.stop_s = duration_s, gap_s, stop_s
        self.windows: list[Window] = []

    def schedule(self, minutes: float, kinds: list[str] | None = None) -> list[str]:
        """Every kind (of ``kinds``, default all) once in a seeded order, then random ones until ``minutes`` are
        filled. Raises ValueError naming an unknown kind."""
        pool = list(kinds or KINDS)
        if unknown := set(pool) - set(KINDS):
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
        order = list(pool)
        self.rng.shuffle(order)
        per = self.duration_s + self.gap_s
        while len(order) * per < minutes * 60 - per:
            order.append(self.rng.choice(pool))
        return order

    def run(self, kinds: list[str], stop: threading.Event | None = None) -> None:
        for kind in kinds:
            if stop is not None and stop.is_set():
                return
            time.sleep(self.gap_s)
            self.apply(kind)

    def apply(self, kind: str) -> Window:
        heal = getattr(self, f"_{kind}")()
        win = self.windows[-1]
        time.sleep(max(self.duration_s, self.stop_s) if kind.startswith("stop_") else self.duration_s)
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
        host = self.d.leader()
        if host is None:
            return self._pick("master")
        return self.d.procs[f"master{host}"]

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


def as_dicts(windows: list[Window]) -> list[dict]:
    return [asdict(w) for w in windows]
