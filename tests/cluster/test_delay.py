"""The NFQUEUE delayer (delay.py) between two network namespaces joined by a veth pair: round-trip times with and
without delay, cleanup after the context manager, and bulk transfers that arrive intact through a delayed link.

Needs root, ``ip`` and ``iptables`` with the xtables NFQUEUE target; skipped otherwise. Everything lives in two
namespaces made per test (names carry this process's pid) with private addresses, removed at teardown.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest

from tests.cluster.delay import delayed, netns_rules

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root (netns, iptables)"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2's ip"),
    pytest.mark.skipif(shutil.which("iptables") is None, reason="needs iptables (xtables NFQUEUE target)"),
]

DEV = "veth0"
ECHO_PORT, SINK_PORT = 7001, 7002
FAST_MS = 20.0  # an undelayed round trip on a veth pair is ~0.1 ms; anything under this is "no delay"
SLACK_MS = 60.0  # allowed above the added delay, per delayed direction
_counter = itertools.count()

# the echo server (mode "echo": echoes every connection) or the sink (mode "sink": reads one connection to EOF,
# answers the blake2b hex digest of what it read); prints "ready" once it listens
SERVER = r"""
import hashlib, socket, sys, threading
mode, port = sys.argv[1], int(sys.argv[2])
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("0.0.0.0", port))
ls.listen(16)
print("ready", flush=True)

def echo(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := c.recv(65536):
        c.sendall(data)
    c.close()

def sink(c):
    h = hashlib.blake2b()
    while data := c.recv(1 << 20):
        h.update(data)
    c.sendall(h.hexdigest().encode())
    c.close()

while True:
    c, _ = ls.accept()
    threading.Thread(target=echo if mode == "echo" else sink, args=(c,), daemon=True).start()
"""

# round trips of 64 bytes on one connection: prints a JSON list of milliseconds (after 2 warm-up trips)
RTT_CLIENT = r"""
import json, socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = socket.create_connection((host, port), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out = []
for i in range(n + 2):
    t = time.perf_counter()
    c.sendall(b"p" * 64)
    got = 0
    while got < 64:
        got += len(c.recv(64 - got))
    out.append((time.perf_counter() - t) * 1000.0)
print(json.dumps(out[2:]))
"""

# sends N seeded pseudo-random bytes, half-closes, prints {"sent": digest, "got": the sink's digest, "s": seconds}
BULK_CLIENT = r"""
import hashlib, json, random, socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = random.Random(n).randbytes(n)
t = time.monotonic()
c = socket.create_connection((host, port), timeout=30)
c.sendall(data)
c.shutdown(socket.SHUT_WR)
got = b""
while chunk := c.recv(256):
    got += chunk
print(json.dumps({"sent": hashlib.blake2b(data).hexdigest(), "got": got.decode(), "s": time.monotonic() - t}))
"""


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)} failed: {out.stderr.strip()}")
    return out


@dataclass
class Link:
    a: str  # namespace names
    b: str
    addr_a: str
    addr_b: str


def _delete_netns(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:  # processes this test started in it (servers, delayers) that are somehow still there
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", ns, check=False)


@pytest.fixture
def link() -> Iterator[Link]:
    n = next(_counter)
    tag = f"kvpd{os.getpid()}x{n}"
    a, b = f"{tag}a", f"{tag}b"
    subnet = f"10.231.{(os.getpid() + n) % 250 + 1}"
    made: list[str] = []
    try:
        for ns in (a, b):
            out = _ip("netns", "add", ns, check=False)
            if out.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {out.stderr.strip()}")
            made.append(ns)
        _ip("link", "add", DEV, "netns", a, "type", "veth", "peer", "name", DEV, "netns", b)
        for ns, addr in ((a, f"{subnet}.1"), (b, f"{subnet}.2")):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", DEV)
            _ip("-n", ns, "link", "set", DEV, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        probe = ["-o", "lo", "-j", "NFQUEUE", "--queue-num", "65000", "--queue-bypass"]
        out = subprocess.run(["ip", "netns", "exec", a, "iptables", "-w", "-I", "OUTPUT", *probe], capture_output=True)
        if out.returncode != 0:
            pytest.skip(f"no xtables NFQUEUE target: {out.stderr.decode().strip()}")
        subprocess.run(["ip", "netns", "exec", a, "iptables", "-w", "-D", "OUTPUT", *probe], check=True)
        yield Link(a, b, f"{subnet}.1", f"{subnet}.2")
    finally:
        for ns in made:
            _delete_netns(ns)


def _in_ns(ns: str, script: str, *args: object) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-c", script, *map(str, args)]


@contextmanager
def _server(ns: str, mode: str, port: int) -> Iterator[None]:
    proc = subprocess.Popen(_in_ns(ns, SERVER, mode, port), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield
    finally:
        proc.kill()
        proc.wait()


def _rtts(link: Link, n: int = 20) -> list[float]:
    out = subprocess.run(
        _in_ns(link.a, RTT_CLIENT, link.addr_b, ECHO_PORT, n), capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _bulk(link: Link, size: int) -> dict[str, object]:
    out = subprocess.run(
        _in_ns(link.a, BULK_CLIENT, link.addr_b, SINK_PORT, size),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def _nfqueue_rules(ns: str) -> list[str]:
    return [r for d in ("egress", "ingress") for r in netns_rules(ns, d) if "NFQUEUE" in r]


@pytest.mark.parametrize(
    "direction,sides,delay_ms,jitter_ms",
    [
        ("egress", "a", 100.0, 0.0),
        ("egress", "ab", 100.0, 0.0),
        ("egress", "a", 100.0, 20.0),
        ("ingress", "ab", 100.0, 0.0),
    ],
)
def test_round_trip_time(link: Link, direction: str, sides: str, delay_ms: float, jitter_ms: float) -> None:
    """The median of 20 TCP round trips is < 20 ms undelayed, and within [delay - jitter, delay + jitter + 60 ms] per
    delayed direction with the delayer on one side's or both sides' OUTPUT (egress) or PREROUTING (ingress)."""
    with _server(link.b, "echo", ECHO_PORT):
        base = _median(_rtts(link))
        assert base < FAST_MS, base
        with ExitStack() as stack:
            for ns in [link.a if side == "a" else link.b for side in sides]:
                stack.enter_context(delayed(ns, DEV, delay_ms, jitter_ms, direction=direction))
            rtts = _rtts(link)
        k = len(sides)
        lo, hi = k * (delay_ms - jitter_ms), k * (delay_ms + jitter_ms + SLACK_MS)
        assert lo <= _median(rtts) <= hi, (base, _median(rtts), rtts)
        assert min(rtts) >= lo - 1.0, rtts


def test_cleanup_after_exit(link: Link) -> None:
    """While delayed, the rule is in place (tagged with the delayer's pid) and the RTT is up; after the ``with``, the
    RTT is back under 20 ms and neither namespace has an NFQUEUE rule left."""
    with _server(link.b, "echo", ECHO_PORT):
        with delayed(link.a, DEV, 50.0) as handle:
            rules = _nfqueue_rules(link.a)
            assert len(rules) == 1 and handle.tag in rules[0] and f"-o {DEV}" in rules[0], rules
            assert _median(_rtts(link, 10)) >= 50.0
        assert handle.proc.returncode == 0
        assert _median(_rtts(link)) < FAST_MS
        assert _nfqueue_rules(link.a) == [] and _nfqueue_rules(link.b) == []
        rules = subprocess.run(
            ["ip", "netns", "exec", link.a, "iptables", "-S", "OUTPUT"], capture_output=True, text=True, check=True
        ).stdout
        assert "NFQUEUE" not in rules, rules


def test_killed_delayer_bypasses_and_is_cleaned_up(link: Link) -> None:
    """A delayer killed with SIGKILL leaves its rule, but --queue-bypass lets traffic pass undelayed; leaving the
    ``with`` then raises and removes the rule."""
    with _server(link.b, "echo", ECHO_PORT):
        with pytest.raises(RuntimeError, match="left its rule behind"):
            with delayed(link.a, DEV, 100.0, queue=3) as handle:
                os.kill(handle.proc.pid, signal.SIGKILL)
                handle.proc.wait()
                assert len(_nfqueue_rules(link.a)) == 1
                assert _median(_rtts(link, 10)) < FAST_MS
        assert _nfqueue_rules(link.a) == []


def test_start_failure_is_reported(link: Link) -> None:
    """A device that does not exist in the namespace: the delayer exits before adding a rule, and ``delayed`` says
    why."""
    with pytest.raises(RuntimeError, match="did not start"):
        with delayed(link.a, "nosuchdev0", 10.0):
            pass
    assert _nfqueue_rules(link.a) == []


@pytest.mark.parametrize(
    "direction,size,delay_ms,jitter_ms,max_s",
    [
        # ingress: the delayed packets are no longer charged to the sending socket, so TCP fills the window
        ("ingress", 8 << 20, 50.0, 10.0, 15.0),
        # egress: TCP small queues let the sender keep only ~2 packets in the delayer: ~100-250 KB/s
        ("egress", 512 << 10, 20.0, 5.0, 15.0),
    ],
)
def test_bulk_transfer_is_intact(
    link: Link, direction: str, size: int, delay_ms: float, jitter_ms: float, max_s: float
) -> None:
    """A bulk TCP transfer through a link delayed (with jitter) on both sides arrives with the same blake2b digest:
    nothing lost or reordered into corruption."""
    with _server(link.b, "sink", SINK_PORT):
        with delayed(link.a, DEV, delay_ms, jitter_ms, direction=direction):
            with delayed(link.b, DEV, delay_ms, jitter_ms, direction=direction):
                t = time.monotonic()
                result = _bulk(link, size)
                elapsed = time.monotonic() - t
        assert result["got"] == result["sent"], result
        assert elapsed < max_s, (elapsed, result)
