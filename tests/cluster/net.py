"""Hosts as network namespaces on one machine, with real links between them (after ../shared/recipes/netns-cluster.sh).

Each host ``h<i>`` is a namespace ``<prefix>h<i>`` with one veth link ``eth0`` (address ``10.99.0.<i>/24``) to a
bridge that lives in its own namespace ``<prefix>sw``: nothing touches the machine's own network, and the addresses
exist only inside namespaces this object made (``down()`` removes them all; the prefix carries this process's pid,
so two runs never meet). Processes started with ``command(i, argv)`` run in host i under their own UTS namespace
with hostname ``h<i>``: the transfer core's host id (hostname + boot id) differs per host, so shared memory and the
same-host cross-process read are never chosen between hosts, though the namespaces share the filesystem.

Links: ``shape(i, rate=, loss=)`` (rate: tc tbf on both ends of host i's link; loss: nftables random drop of what
host i receives), ``cut(i)`` / ``heal(i)`` (host i's switch port down / up: a partition of host i), ``drop(i,
peers)`` / ``undrop(i)`` (host i silently drops what it receives from ``peers``: one-way when only one side drops),
``block(i, peers)`` (both directions between host i and ``peers``, the rest of its links intact). Added delay has no
qdisc on this kernel (no netem, no fq): delay.py queues packets to a user-space delayer over NFQUEUE instead.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

SUBNET = "10.99.0"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


class Net:
    """N hosts (1..N) on a private bridge. Use as a context manager, or call ``up()`` and ``down()``."""

    def __init__(self, hosts: int, prefix: str | None = None):
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts={hosts}: use 1..200")
        self.n = hosts
        self.prefix = prefix or f"kc{os.getpid() % 100000}"  # veth names must fit 15 characters
        self.switch = f"{self.prefix}sw"
        self._made: list[str] = []

    # ---- names -----------------------------------------------------------------------------------------
    def ns(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    @staticmethod
    def ip(i: int) -> str:
        return f"{SUBNET}.{i}"

    def hosts(self) -> range:
        return range(1, self.n + 1)

    def in_ns(self, i: int, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", self.ns(i), *argv, check=check)

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """argv run as a process of host i (its namespace, its own hostname ``h<i>``); the pid Popen reports is
        the process's own (every wrapper execs)."""
        wrap = ["ip", "netns", "exec", self.ns(i), "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"']
        return [*wrap, f"h{i}", *argv]

    # ---- life cycle --------------------------------------------------------------------------------------
    def up(self) -> Net:
        self._add_ns(self.switch)
        sw = ("ip", "netns", "exec", self.switch)
        _run(*sw, "ip", "link", "add", "br0", "type", "bridge")
        _run(*sw, "ip", "link", "set", "br0", "up")
        _run(*sw, "ip", "link", "set", "lo", "up")
        for i in self.hosts():
            self._add_host(i)
        return self

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)

    def _add_host(self, i: int) -> None:
        ns, a, b = self.ns(i), f"{self.prefix}a{i}", f"{self.prefix}b{i}"
        self._add_ns(ns)
        _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        _run("ip", "link", "set", a, "netns", ns)
        _run("ip", "link", "set", b, "netns", self.switch)
        self.in_ns(i, "ip", "link", "set", a, "name", "eth0")
        self.in_ns(i, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
        self.in_ns(i, "ip", "link", "set", "eth0", "up")
        self.in_ns(i, "ip", "link", "set", "lo", "up")
        sw = ("ip", "netns", "exec", self.switch)
        _run(*sw, "ip", "link", "set", b, "name", f"v{i}")
        _run(*sw, "ip", "link", "set", f"v{i}", "master", "br0")
        _run(*sw, "ip", "link", "set", f"v{i}", "up")
        for table in ("kvploss", "kvpdrop"):  # one nftables table per fault kind, each with an input chain
            self.in_ns(i, "nft", "add", "table", "inet", table)
            self.in_ns(i, "nft", "add", "chain", "inet", table, "in", "{ type filter hook input priority 0; }")
        self.in_ns(i, "nft", "add", "chain", "inet", "kvpdrop", "out", "{ type filter hook output priority 0; }")

    def down(self) -> None:
        """Remove every namespace this object made (their links and rules go with them)."""
        for name in reversed(self._made):
            _run("ip", "netns", "del", name, check=False)
        self._made.clear()

    def __enter__(self) -> Net:
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- link faults -------------------------------------------------------------------------------------
    def shape(self, i: int, rate: str | None = None, loss: float | None = None, queue_ms: int = 400) -> None:
        """Host i's link: ``rate`` (e.g. "10mbit"; "" removes it) on both ends, with a drop-tail queue of
        ``queue_ms`` at that rate (tbf latency; this kernel has no fair queueing qdisc), ``loss`` percent of what
        host i receives dropped at random (0 removes it)."""
        if rate is not None:
            for ns, dev in ((self.ns(i), "eth0"), (self.switch, f"v{i}")):
                if rate:
                    tbf = ("tbf", "rate", rate, "burst", "256kbit", "latency", f"{queue_ms}ms")
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf)
                else:
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if loss is not None:
            self.in_ns(i, "nft", "flush", "chain", "inet", "kvploss", "in")
            if loss > 0:
                rule = f"iifname eth0 numgen random mod 10000 lt {int(loss * 100)} drop"
                self.in_ns(i, "nft", "add", "rule", "inet", "kvploss", "in", *rule.split())

    def cut(self, i: int) -> None:
        """Partition host i from every other host (its switch port down)."""
        _run("ip", "netns", "exec", self.switch, "ip", "link", "set", f"v{i}", "down")

    def heal(self, i: int) -> None:
        _run("ip", "netns", "exec", self.switch, "ip", "link", "set", f"v{i}", "up")

    def drop(self, i: int, peers: Sequence[int]) -> None:
        """Host i silently drops every packet it receives from ``peers`` (what it sends still arrives)."""
        for j in peers:
            self.in_ns(i, "nft", "add", "rule", "inet", "kvpdrop", "in", "ip", "saddr", self.ip(j), "drop")

    def block(self, i: int, peers: Sequence[int]) -> None:
        """No packet between host i and ``peers``, either way; host i's other links are untouched."""
        self.drop(i, peers)
        for j in peers:
            self.in_ns(i, "nft", "add", "rule", "inet", "kvpdrop", "out", "ip", "daddr", self.ip(j), "drop")

    def undrop(self, i: int) -> None:
        for chain in ("in", "out"):
            self.in_ns(i, "nft", "flush", "chain", "inet", "kvpdrop", chain)
