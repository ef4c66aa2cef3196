"""Connection limits shared by every server of kvplugins: the master's raw RPC endpoint, the transfer TCP
server, a node's disk-tier promote endpoint and the Prometheus endpoints (issue #11).

Lifecycle, per server:
1. ``accept()`` fails (EMFILE, ENFILE, ENOBUFS, ENOMEM: descriptors or kernel memory ran out):
   ``AcceptBackoff.failed(err)`` logs it (once per interval, with the count of the rest) and returns how long to
   stop accepting; the server keeps serving its established connections meanwhile and calls ``ok()`` after
   the next accept that succeeds. Any other accept error is the server's own to raise.
2. Each accepted connection: ``ConnGate.admit(peer)`` returns None (counted; call ``release(peer)`` when it
   closes) or the refusal text to send the peer before closing it (nothing is counted then).
3. Idle and slow peers: each server times them out against ``ConnLimits.idle_timeout_s`` (no request for
   that long) and ``frame_timeout_s`` (a frame started must complete within it).

Every class here is thread-safe; one instance per server, never module state.
"""
from __future__ import annotations

import errno
import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("kvplugins.security")
RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True)
class ConnLimits:
    """One server's connection limits. ``max_connections``/``max_per_peer``: open connections in all and per
    peer host (0 = unlimited); ``idle_timeout_s``: a connection with no request for this long is closed (0 =
    never); ``frame_timeout_s``: a frame (or handshake) started must complete within this (slowloris)."""
    max_connections: int = 4096
    max_per_peer: int = 1024
    idle_timeout_s: float = 600.0
    frame_timeout_s: float = 10.0


def peer_host(peer) -> str:
    """The host part of a socket peer address ((host, port[, ...]) or "host:port")."""
    return str(peer[0]) if isinstance(peer, tuple) else str(peer).rsplit(":", 1)[0]


class ConnGate:
    """Counts open connections in all and per peer host against a server's ConnLimits."""

    def __init__(self, limits: ConnLimits, what: str, config_prefix: str):
        self.limits, self.what, self.prefix = limits, what, config_prefix
        self._lock = threading.Lock()
        self._per_host: dict[str, int] = {}
        self.total = 0
        self.refused = 0

    def admit(self, peer) -> str | None:
        """Count a new connection from ``peer``, or return why it is refused (not counted)."""
        host, lim = peer_host(peer), self.limits
        with self._lock:
            n = self._per_host.get(host, 0)
            if lim.max_connections and self.total >= lim.max_connections:
                reason = (f"{self.what} has {self.total} connections open, its limit "
                          f"({self.prefix}max_connections={lim.max_connections}); retry later or raise it")
            elif lim.max_per_peer and n >= lim.max_per_peer:
                reason = (f"{host} has {n} connections open to {self.what}, the per-peer limit "
                          f"({self.prefix}max_connections_per_peer={lim.max_per_peer}); close some or raise it")
            else:
                self._per_host[host] = n + 1
                self.total += 1
                return None
            self.refused += 1
            return reason

    def release(self, peer) -> None:
        """A connection counted by ``admit`` closed."""
        host = peer_host(peer)
        with self._lock:
            n = self._per_host.get(host, 0) - 1
            if n > 0:
                self._per_host[host] = n
            else:
                self._per_host.pop(host, None)
            self.total -= 1


class AcceptBackoff:
    """What a server does when ``accept()`` fails for lack of descriptors or memory: a rate-limited log line and
    a pause that doubles from ``first_s`` up to ``max_s`` while the failures go on."""

    def __init__(self, what: str, first_s: float = 0.01, max_s: float = 0.5, log_interval_s: float = 10.0):
        self.what, self.first_s, self.max_s, self.log_interval_s = what, first_s, max_s, log_interval_s
        self._lock = threading.Lock()
        self._pause = 0.0
        self._last_log = -1e18
        self._hidden = 0
        self.failures = 0

    @staticmethod
    def retryable(err: OSError) -> bool:
        """True for the accept() errors a server must survive (EMFILE, ENFILE, ENOBUFS, ENOMEM)."""
        return err.errno in RETRY_ERRNOS

    def failed(self, err: OSError) -> float:
        """Record a failed accept; returns the seconds to stop accepting."""
        now = time.monotonic()
        with self._lock:
            self.failures += 1
            self._pause = min(self.max_s, max(self.first_s, self._pause * 2))
            if now - self._last_log < self.log_interval_s:
                self._hidden += 1
                return self._pause
            hidden, self._hidden, self._last_log = self._hidden, 0, now
        more = f" ({hidden} more since the last line)" if hidden else ""
        log.warning("%s: accept failed (%s); established connections keep being served, accepting again in "
                    "%.0f ms%s; raise the descriptor limit (ulimit -n) or lower max_connections", self.what,
                    err.strerror or err, self._pause * 1000, more)
        return self._pause

    def ok(self) -> None:
        """An accept succeeded: the next failure starts from the first pause again."""
        self._pause = 0.0
