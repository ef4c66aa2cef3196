"""A private network namespace for the run: Mooncake's master and HTTP metadata server bind 0.0.0.0, so they
(and, for fairness, our store) only ever run inside ``kvpbench-<pid>`` with just ``lo`` up. Needs root and
``ip`` (iproute2). The namespace and every process left in it are removed on exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

ENV = "KVPBENCH_NETNS"


def inside() -> bool:
    """True when this process runs in a network namespace other than init's (i.e. in our private one)."""
    try:
        return os.readlink("/proc/self/ns/net") != os.readlink("/proc/1/ns/net")
    except OSError:
        return bool(os.environ.get(ENV))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def run_inside(argv: list[str]) -> int:
    """Create ``kvpbench-<pid>``, bring ``lo`` up, run ``python argv`` in it, then kill what is left and delete it."""
    if os.geteuid() != 0:
        raise SystemExit("--vs mooncake runs Mooncake inside a private network namespace and needs root (ip netns)")
    ns = f"kvpbench-{os.getpid()}"
    interrupt_on_signals()
    _ip("netns", "add", ns)
    try:
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *argv], env=dict(os.environ, **{ENV: ns}))
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            try:
                return proc.wait(15)
            except subprocess.TimeoutExpired:
                return 130
    finally:
        _kill_all_in(ns)
        _ip("netns", "del", ns, check=False)


def interrupt_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt, so ``finally`` blocks stop servers and remove the namespace
    (also when started in the background, where SIGINT is ignored by default)."""

    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise)


def _kill_all_in(ns: str) -> None:
    """SIGTERM then SIGKILL every process still in ``ns`` (all were started by this run)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if pids:
            time.sleep(1.0)
