"""Add a fixed delay (optionally with jitter) to the IPv4 packets one network namespace sends out of (or receives on)
one device, without netem: a user-space delayer over NFQUEUE, in pure Python (stdlib only).

Why: the kernel of the test machines has no ``sch_netem`` (``tc qdisc add ... netem`` answers "Specified qdisc kind
is unknown"; no ``fq`` either), but it has NFQUEUE (``CONFIG_NETFILTER_NETLINK_QUEUE``, ``xt_NFQUEUE``). So an
``iptables -I OUTPUT -o DEV -j NFQUEUE --queue-num N --queue-bypass`` rule hands every packet leaving through DEV to
this process, which leaves it in the kernel's queue and gives it back (``NF_ACCEPT``) once the delay has passed
since it arrived here. (Nftables' own ``queue`` statement is not used: ``CONFIG_NFT_QUEUE`` is unset; the
iptables-nft rule goes through the xtables NFQUEUE target.) ``--direction ingress`` puts the rule on
``-t mangle PREROUTING -i DEV`` instead: the packets arriving on DEV are delayed.

How: a raw netlink socket (``AF_NETLINK``, ``NETLINK_NETFILTER``) binds queue N with one ``NFQNL_MSG_CONFIG``
(``NFQNL_CFG_CMD_BIND``; copy mode ``NFQNL_COPY_META``, so no payload is copied; ``NFQA_CFG_QUEUE_MAXLEN`` 65536;
flags ``NFQA_CFG_F_FAIL_OPEN``, so a full queue or a full socket accepts a packet instead of dropping it, and
``NFQA_CFG_F_GSO``, so GSO packets are queued whole instead of segmented). Each ``NFQNL_MSG_PACKET`` is stamped with
``time.monotonic()`` when it is read, its id taken from ``NFQA_PACKET_HDR``, and it joins a FIFO with its release
time ``arrival + delay (+ uniform(-jitter, +jitter))``, never earlier than the release time of the packet before it,
so the order is kept (unlike netem, jitter never reorders). Due packets are released with one
``NFQNL_MSG_VERDICT_BATCH`` (accept every queued id up to the newest due one) per wake-up.

Run it inside the namespace; it runs until SIGTERM or SIGINT, then removes exactly the rule it added (tagged with a
comment naming its pid), lets the packets it still holds go at their time, and exits 0 without output::

    ip netns exec NS python -m tests.cluster.delay --queue 7 --dev eth0 --delay-ms 200 [--jitter-ms 20]
        [--direction egress|ingress] [--stats]

It prints one line, ``ready <rule tag>``, on stdout once the queue is bound and the rule is in place. From Python
(the cluster harness's API): ``with delayed(netns, dev, delay_ms, jitter_ms=0, queue=7, direction="egress") as h:``
starts it, waits for that line, and on exit stops it and checks that the rule is gone (RuntimeError otherwise).

Measured (tests/cluster/test_delay.py; a veth pair between two namespaces, 2-CPU VM, kernel 6.18): TCP round trip
0.03 ms undelayed; 100.6 ms with 100 ms on one side, 201.0 ms with 100 ms on both (egress or ingress), 200.7 ms with
200 ms on one side; back to 0.02 ms after the ``with``. UDP flood of 36-byte datagrams through an ingress delay of
200 ms: 120k packets/s kept up (the Python sender's limit, not the delayer's) with no overrun, one-way delay p50
200.2 ms, p99 205.7 ms, max 211.5 ms; at 1k packets/s p99 202.1 ms. The delayer used ~0.6 CPU at 120k/s (its CPU
includes the kernel's re-injection of the packets it accepts), ~0.4 CPU at 20k/s (fewer packets per wake-up).

Limits:

* TCP through an egress delay is slow: a delayed packet is still charged to its socket, and TCP's small-queue limit
  (TSQ: about 1 ms of the pacing rate, at least two packets) then holds the sender to ~2 packets per delay. Measured
  bulk: 0.27 MB/s at 2x20 ms, 0.06-0.1 MB/s at 2x50 ms. Behind an ingress delay the packet was already orphaned
  (``ip_rcv``), so TCP fills its window: 8 MiB in 1.2 s at 2x50 ms, 32 MiB in 4.2 s at 2x100 ms. For bulk traffic
  delay the receiver's ingress (the same RTT). Request/response traffic is unaffected either way. UDP senders are
  held to their socket's send buffer per delay on egress (``SO_SNDBUF``) in the same way.
* IPv4 only (iptables, not ip6tables); one device, one direction per delayer (one queue number per delayer in a
  namespace; different namespaces may use the same number); delay only: no loss, rate or reordering.
* Capacity: Python pays one ``recv`` and a little parsing per packet (figures above). Should the delayer fall
  behind so far that its socket buffer (64 MiB, ``SO_RCVBUFFORCE``) or the queue (65536 packets) fills, packets
  pass undelayed (fail-open) rather than being dropped; ``--stats`` prints the counts (overruns too) at exit.
* Timer resolution: ``poll()`` in milliseconds, so a packet goes out 0-1 ms (plus scheduling) after its time.
* A delayer killed with SIGKILL unbinds its queue and ``--queue-bypass`` lets traffic pass undelayed, but its rule
  stays; ``delayed`` then removes it and raises. The packets it held are dropped by the kernel (TCP resends them).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import select
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# linux/netlink.h
NETLINK_NETFILTER = 12
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLMSG_NOOP, NLMSG_ERROR, NLMSG_DONE, NLMSG_OVERRUN = 1, 2, 3, 4
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
# linux/netfilter/nfnetlink.h
NFNETLINK_V0 = 0
NFNL_SUBSYS_QUEUE = 3
# linux/netfilter/nfnetlink_queue.h
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 0x1, 0x4
# linux/netfilter.h
NF_ACCEPT = 1

QUEUE_MAXLEN = 65536
RCVBUF = 64 << 20
READY = "ready"
_PACKET_TYPE = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, portid (host order)
_NFGENMSG = struct.Struct("!BBH")  # family, version, res_id (the queue number, big-endian)
_NLATTR = struct.Struct("=HH")  # len, type (host order)
_BE32 = struct.Struct("!I")
_ERRNO = struct.Struct("=i")


def _attr(kind: int, payload: bytes) -> bytes:
    size = _NLATTR.size + len(payload)
    return _NLATTR.pack(size, kind) + payload + b"\0" * (-size % 4)


def _message(kind: int, flags: int, seq: int, queue: int, attrs: bytes) -> bytes:
    body = _NFGENMSG.pack(socket.AF_UNSPEC, NFNETLINK_V0, queue) + attrs
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


class NfQueue:
    """One bound NFQUEUE queue on a raw netlink socket, in the calling process's network namespace."""

    def __init__(self, queue: int) -> None:
        self.queue = queue
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        self.sock.bind((0, 0))
        self._seq = 0
        flags = NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO
        self._config(
            _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET))
            + _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
            + _attr(NFQA_CFG_QUEUE_MAXLEN, _BE32.pack(QUEUE_MAXLEN))
            + _attr(NFQA_CFG_MASK, _BE32.pack(flags))
            + _attr(NFQA_CFG_FLAGS, _BE32.pack(flags))
        )
        self.sock.setblocking(False)
        # a batch verdict: the header up to the verdict's id, which is appended per message
        self._verdict_prefix = _message(
            NFQNL_MSG_VERDICT_BATCH, NLM_F_REQUEST, 0, queue, _attr(NFQA_VERDICT_HDR, _BE32.pack(NF_ACCEPT) + bytes(4))
        )[:-4]

    def _config(self, attrs: bytes) -> None:
        """Send one NFQNL_MSG_CONFIG and wait for its acknowledgement (raising its error)."""
        self._seq += 1
        self.sock.send(_message(NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, self._seq, self.queue, attrs))
        while True:
            data = self.sock.recv(65536)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, kind, _flags, seq, _portid = _NLMSGHDR.unpack_from(data, offset)
                if kind == NLMSG_ERROR and seq == self._seq:
                    code = -_ERRNO.unpack_from(data, offset + _NLMSGHDR.size)[0]
                    if code:
                        hint = " (is the queue bound by another process?)" if code in (errno.EPERM, errno.EBUSY) else ""
                        raise OSError(code, f"NFQUEUE {self.queue} config: {os.strerror(code)}{hint}")
                    return
                if length < _NLMSGHDR.size:
                    break
                offset += (length + 3) & ~3

    def accept_upto(self, packet_id: int) -> None:
        """Accept every packet of the queue whose id is ``packet_id`` or older (NFQNL_MSG_VERDICT_BATCH)."""
        while True:
            try:
                self.sock.send(self._verdict_prefix + _BE32.pack(packet_id))
                return
            except BlockingIOError:
                select.select([], [self.sock], [], 0.01)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.setblocking(True)
            self._config(_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_UNBIND, socket.AF_INET)))
        self.sock.close()


@dataclass
class Stats:
    packets: int = 0
    overruns: int = 0  # ENOBUFS: the socket's buffer was full, those packets passed undelayed (fail-open)
    netlink_errors: int = 0
    max_held: int = 0
    verdicts: int = 0


class Delayer:
    """Holds each packet of an NfQueue until its release time, in arrival order."""

    def __init__(self, nfq: NfQueue, delay_s: float, jitter_s: float = 0.0) -> None:
        self.nfq = nfq
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.held: deque[tuple[float, int]] = deque()  # (release time, packet id), release times non-decreasing
        self.stats = Stats()
        self._last_release = 0.0
        self._buf = bytearray(65536)

    def read(self) -> bool:
        """Read every message waiting on the socket; False when nothing was there."""
        buf, view, sock, held, stats = self._buf, memoryview(self._buf), self.nfq.sock, self.held, self.stats
        delay, jitter, last = self.delay_s, self.jitter_s, self._last_release
        unpack_hdr, unpack_attr, unpack_id = _NLMSGHDR.unpack_from, _NLATTR.unpack_from, _BE32.unpack_from
        got = False
        for _ in range(4096):  # then let due packets go before reading on
            try:
                size = sock.recv_into(view)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    stats.overruns += 1
                    continue
                raise
            now = time.monotonic()
            got = True
            offset = 0
            while offset + 16 <= size:
                length, kind = unpack_hdr(buf, offset)[:2]
                if length < 16:
                    break
                if kind == _PACKET_TYPE:
                    attr, end = offset + 20, offset + length
                    while attr + 4 <= end:
                        alen, akind = unpack_attr(buf, attr)
                        if alen < 4:
                            break
                        if akind & 0x7FFF == NFQA_PACKET_HDR:
                            release = now + delay
                            if jitter:
                                release += random.uniform(-jitter, jitter)
                            if release < last:
                                release = last
                            last = release
                            held.append((release, unpack_id(buf, attr + 4)[0]))
                            stats.packets += 1
                            break
                        attr += (alen + 3) & ~3
                elif kind == NLMSG_ERROR and _ERRNO.unpack_from(buf, offset + 16)[0]:
                    stats.netlink_errors += 1
                offset += (length + 3) & ~3
        self._last_release = last
        if len(held) > stats.max_held:
            stats.max_held = len(held)
        return got

    def release(self) -> float | None:
        """Accept the packets that are due; return the seconds until the next one is (None: nothing held)."""
        held = self.held
        now = time.monotonic()
        last_id = None
        while held and held[0][0] <= now:
            last_id = held.popleft()[1]
        if last_id is not None:
            self.nfq.accept_upto(last_id)
            self.stats.verdicts += 1
        return max(0.0, held[0][0] - now) if held else None


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"iptables {shlex.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


CHAINS = {"egress": ("filter", "OUTPUT", "-o"), "ingress": ("mangle", "PREROUTING", "-i")}


def rule_spec(direction: str, dev: str, queue: int, tag: str) -> tuple[str, str, list[str]]:
    """The rule's table, chain, and match and target (for ``iptables -t TABLE -I|-D CHAIN ...``)."""
    table, chain, dev_flag = CHAINS[direction]
    rule = [dev_flag, dev, "-m", "comment", "--comment", tag, "-j", "NFQUEUE", "--queue-num", str(queue)]
    return table, chain, rule + ["--queue-bypass"]


def run(
    queue: int, dev: str, delay_ms: float, jitter_ms: float = 0.0, direction: str = "egress", stats: bool = False
) -> int:
    """The delayer process: bind, add the rule, delay until SIGTERM/SIGINT, remove the rule, let the rest go."""
    socket.if_nametoindex(dev)  # OSError if DEV is not in this namespace
    stop_r, stop_w = socket.socketpair()
    stop_r.setblocking(False)
    stop_w.setblocking(False)
    signal.set_wakeup_fd(stop_w.fileno(), warn_on_full_buffer=False)
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    tag = f"kvplugins-delay q{queue} pid{os.getpid()}"
    table, chain, spec = rule_spec(direction, dev, queue, tag)
    nfq = NfQueue(queue)
    delayer = Delayer(nfq, delay_ms / 1000.0, jitter_ms / 1000.0)
    started = time.monotonic()
    rule_added = False
    try:
        if not stopping:
            _iptables("-t", table, "-I", chain, *spec)
            rule_added = True
            print(f"{READY} {tag}", flush=True)
        poller = select.poll()
        poller.register(nfq.sock, select.POLLIN)
        poller.register(stop_r, select.POLLIN)
        deadline = None  # once stopping: the last held packet's release, plus a margin
        quiet_since = None  # once stopping and nothing held: since when nothing more came
        while True:
            wait = delayer.release()
            if stopping and deadline is None:
                if rule_added:
                    _iptables("-t", table, "-D", chain, *spec)
                    rule_added = False
                deadline = time.monotonic() + delayer.delay_s + delayer.jitter_s + 1.0
            if deadline is not None:
                now = time.monotonic()
                if len(stopping) > 1 or now >= deadline:
                    break
                if wait is None:  # nothing held: wait a little for packets that passed the rule as it went
                    if delayer.read():
                        quiet_since = None
                        continue
                    quiet_since = quiet_since or now
                    if now - quiet_since >= 0.05:
                        break
                    wait = 0.01
            timeout_ms = -1 if wait is None else int(wait * 1000.0 + 0.999)
            for fd, _event in poller.poll(timeout_ms):
                if fd == stop_r.fileno():
                    with contextlib.suppress(BlockingIOError):
                        stop_r.recv(64)
                else:
                    delayer.read()
    finally:
        if rule_added:
            _iptables("-t", table, "-D", chain, *spec, check=False)
        if delayer.held:  # a second signal: let what is held go now rather than have the kernel drop it
            nfq.accept_upto(delayer.held[-1][1])
        nfq.close()
    if stats:
        info = dict(
            vars(delayer.stats), seconds=round(time.monotonic() - started, 3), cpu_s=round(time.process_time(), 3)
        )
        print(json.dumps(info), file=sys.stderr, flush=True)
    return 0


# -- the harness's API ----------------------------------------------------------------------------------------------


@dataclass
class DelayHandle:
    netns: str
    dev: str
    delay_ms: float
    jitter_ms: float
    queue: int
    direction: str
    tag: str  # the rule's comment, unique to the delayer process
    proc: subprocess.Popen[str]


def netns_rules(netns: str, direction: str = "egress") -> list[str]:
    """``iptables -S`` of the chain a delayer in ``direction`` puts its rule in, in network namespace ``netns``."""
    table, chain, _flag = CHAINS[direction]
    cmd = ["ip", "netns", "exec", netns, "iptables", "-w", "-t", table, "-S", chain]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()


@contextlib.contextmanager
def delayed(
    netns: str,
    dev: str,
    delay_ms: float,
    jitter_ms: float = 0.0,
    queue: int = 7,
    direction: str = "egress",
    ready_timeout_s: float = 15.0,
) -> Iterator[DelayHandle]:
    """Delay the IPv4 packets that network namespace ``netns`` sends out of ``dev`` (``direction="egress"``, filter
    OUTPUT) or receives on it (``"ingress"``, mangle PREROUTING) by ``delay_ms``, plus uniform(-jitter_ms, +jitter_ms)
    with the order kept, for the body of the ``with``. Each delayer in one namespace needs its own ``queue``.

    Egress delays hold the sender's own packets, which TCP's small-queue limit counts against the socket: bulk TCP
    through an egress delay crawls (~100 KB/s at 2x50 ms); use ``"ingress"`` on the receiving side for bulk
    (module docstring). Raises RuntimeError if the delayer does not start, or if on exit it did not stop cleanly or
    its rule was left behind (which is then removed here)."""
    if direction not in CHAINS:
        raise ValueError(f"direction must be one of {sorted(CHAINS)}, not {direction!r}")
    cmd = ["ip", "netns", "exec", netns, sys.executable, str(Path(__file__).resolve()), "--queue", str(queue)]
    cmd += ["--dev", dev, "--delay-ms", str(float(delay_ms)), "--jitter-ms", str(float(jitter_ms))]
    cmd += ["--direction", direction]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], ready_timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith(READY + " "):
        proc.kill()
        _out, err = proc.communicate()
        raise RuntimeError(f"delayer in {netns} did not start (rc={proc.returncode}): {line!r} {err.strip()}")
    tag = line[len(READY) + 1 :].strip()
    handle = DelayHandle(netns, dev, delay_ms, jitter_ms, queue, direction, tag, proc)
    problems: list[str] = []
    try:
        yield handle
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _out, err = proc.communicate(timeout=(delay_ms + jitter_ms) / 1000.0 + 10.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            _out, err = proc.communicate()
            problems.append("did not stop on SIGTERM")
        if proc.returncode != 0 or err.strip():
            problems.append(f"rc={proc.returncode} {err.strip()}")
        table = CHAINS[direction][0]
        for rule in netns_rules(netns, direction):
            if tag in rule:
                problems.append(f"left its rule behind: {rule}")
                args = shlex.split(rule)
                if args[:1] == ["-A"]:
                    undo = ["ip", "netns", "exec", netns, "iptables", "-w", "-t", table, "-D", *args[1:]]
                    subprocess.run(undo, capture_output=True, check=False)
    if problems:
        raise RuntimeError(f"delayer in {netns}: " + "; ".join(problems))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=int, default=7, help="NFQUEUE queue number (default 7)")
    parser.add_argument("--dev", required=True, help="delay the packets leaving through this device")
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform +-jitter; order is kept")
    parser.add_argument(
        "--direction",
        choices=sorted(CHAINS),
        default="egress",
        help="egress: packets leaving through DEV (filter OUTPUT -o DEV, the default); "
        "ingress: packets arriving on DEV (mangle PREROUTING -i DEV; use it for TCP bulk, see the docstring)",
    )
    parser.add_argument("--stats", action="store_true", help="print counters as JSON on stderr at exit")
    args = parser.parse_args(argv)
    if args.delay_ms < 0 or args.jitter_ms < 0 or not 0 <= args.queue <= 65535:
        parser.error("--delay-ms and --jitter-ms must be >= 0, --queue in 0..65535")
    return run(args.queue, args.dev, args.delay_ms, args.jitter_ms, args.direction, args.stats)


if __name__ == "__main__":
    sys.exit(main())
