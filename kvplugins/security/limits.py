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
4. A refused peer (step 2) of a threaded server: ``Refuser.refuse(sock, message)`` sends the refusal and
   closes the socket gracefully in the background, so the peer reads the reason instead of a reset.

Every class here is thread-safe; one instance per server, never module state.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass

from kvplugins.security.refusals import RefusalLog

log = logging.getLogger("kvplugins.security")
RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True)
class ConnLimits:
    """One server's connection limits. ``max_connections``/``max_per_peer``: open connections in all and per
    peer host (0 = unlimited); ``idle_timeout_s``: a connection with no request for this long is closed (0 =
    never); ``frame_timeout_s``: a frame (or handshake) started must complete within this (slowloris);
    ``max_per_identity``: open connections per named credential (``role:name``; 0 = unlimited)."""

    max_connections: int = 4096
    max_per_peer: int = 1024
    idle_timeout_s: float = 600.0
    frame_timeout_s: float = 10.0
    max_per_identity: int = 0


def peer_host(peer) -> str:
    """The host part of a socket peer address ((host, port[, ...]) or "host:port")."""
    return str(peer[0]) if isinstance(peer, tuple) else str(peer).rsplit(":", 1)[0]


class ConnGate:
    """Counts open connections in all and per peer host against a server's ConnLimits."""

    def __init__(self, limits: ConnLimits, what: str, config_prefix: str):
        self.limits, self.what, self.prefix = limits, what, config_prefix
        self._lock = threading.Lock()
        self._per_host: dict[str, int] = {}
        self._per_identity: dict[str, int] = {}
        self.total = 0
        self.refused = 0

    def admit(self, peer, identity: str = "") -> str | None:
        """Count a new connection from ``peer`` authenticated as ``identity`` (a named credential, or "" for
        none), or return why it is refused (not counted)."""
        host, lim = peer_host(peer), self.limits
        with self._lock:
            n, k = self._per_host.get(host, 0), self._per_identity.get(identity, 0)
            if lim.max_connections and self.total >= lim.max_connections:
                reason = (
                    f"{self.what} has {self.total} connections open, its limit "
                    f"({self.prefix}max_connections={lim.max_connections}); retry later or raise it"
                )
            elif lim.max_per_peer and n >= lim.max_per_peer:
                reason = (
                    f"{host} has {n} connections open to {self.what}, the per-peer limit "
                    f"({self.prefix}max_connections_per_peer={lim.max_per_peer}); close some or raise it"
                )
            elif identity and lim.max_per_identity and k >= lim.max_per_identity:
                reason = (
                    f"credential {identity} has {k} connections open to {self.what}, the per-identity limit "
                    f"({self.prefix}max_connections_per_identity={lim.max_per_identity}); close some, raise "
                    "it, or give each process its own credential (kvplugins credential --name)"
                )
            else:
                self._per_host[host] = n + 1
                if identity:
                    self._per_identity[identity] = k + 1
                self.total += 1
                return None
            self.refused += 1
            return reason

    def release(self, peer, identity: str = "") -> None:
        """A connection counted by ``admit`` closed."""
        with self._lock:
            _down(self._per_host, peer_host(peer))
            if identity:
                _down(self._per_identity, identity)
            self.total -= 1


def _down(counts: dict[str, int], key: str) -> None:
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


class AcceptBackoff:
    """What a server does when ``accept()`` fails for lack of descriptors or memory: a log line rate-limited per
    errno (a second cause is never hidden behind the first's interval) and a pause that doubles from ``first_s``
    up to ``max_s`` while the failures go on."""

    def __init__(self, what: str, first_s: float = 0.01, max_s: float = 0.5, log_interval_s: float = 10.0):
        self.what, self.first_s, self.max_s, self.log_interval_s = what, first_s, max_s, log_interval_s
        self._lock = threading.Lock()
        self._pause = 0.0
        self._last_log: dict[int | None, float] = {}  # errno -> monotonic s of its last line
        self._hidden: dict[int | None, int] = {}  # errno -> failures not logged since that line
        self.failures = 0

    @staticmethod
    def retryable(err: OSError) -> bool:
        """True for the accept() errors a server must survive (EMFILE, ENFILE, ENOBUFS, ENOMEM)."""
        return err.errno in RETRY_ERRNOS

    def failed(self, err: OSError) -> float:
        """Record a failed accept; returns the seconds to stop accepting."""
        now = time.monotonic()
        with self._lock:
            pause = self._pause = min(self.max_s, max(self.first_s, self._pause * 2))
            code = err.errno
            if now - self._last_log.get(code, -1e18) < self.log_interval_s:
                self._hidden[code] = self._hidden.get(code, 0) + 1
                self.failures += 1
                return pause
            hidden, self._hidden[code], self._last_log[code] = self._hidden.get(code, 0), 0, now
        more = f" ({hidden} more since the last line)" if hidden else ""
        log.warning(
            "%s: accept failed (%s); established connections keep being served, accepting again in "
            "%.0f ms%s; raise the descriptor limit (ulimit -n) or lower max_connections",
            self.what,
            err.strerror or err,
            pause * 1000,
            more,
        )
        with self._lock:  # counted once its line is out: a failure seen in the stats is in the log too
            self.failures += 1
        return pause

    def ok(self) -> None:
        """An accept succeeded: the next failure starts from the first pause again."""
        self._pause = 0.0


class Refuser:
    """Sends an over-limit peer its refusal and closes the connection without losing it: the refusal is sent,
    the write side shut, and the socket held for up to ``hold_s`` seconds while whatever the peer still sends
    is read and dropped (closing with unread bytes would reset the connection, and a reset can discard the
    refusal before the peer reads it). One lazily started thread per server holds at most ``max_held``
    sockets; past that (or if the thread cannot start) a refused socket is closed at once. Thread-safe."""

    def __init__(self, what: str, hold_s: float = 1.0, max_held: int = 256):
        self.what, self.hold_s, self.max_held = what, hold_s, max_held
        self._cond = threading.Condition()
        self._queue: list[tuple[socket.socket, float]] = []
        self._held = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def refuse(self, sock: socket.socket, message: bytes) -> None:
        """Send ``message`` (a few hundred bytes: it fits the send buffer) on ``sock`` and close it gracefully
        (in the background). Never raises; ``sock`` belongs to the Refuser afterwards."""
        try:
            sock.setblocking(False)
            _drain(sock)  # bytes the peer already sent (its first request)
            sock.send(message)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        with self._cond:
            if not self._closed and self._held < self.max_held and self._started():
                self._held += 1
                self._queue.append((sock, time.monotonic() + self.hold_s))
                self._cond.notify()
                return
        sock.close()

    def _started(self) -> bool:
        """Under the lock: the holding thread runs (started now if needed); False if it cannot start."""
        if self._thread is None:
            try:
                self._thread = threading.Thread(target=self._run, name="kvp-refuser", daemon=True)
                self._thread.start()
            except RuntimeError:  # can't start new thread: resources ran out, close at once
                self._thread = None
                return False
        return True

    def _run(self) -> None:
        try:
            sel = selectors.DefaultSelector()
        except OSError:  # no descriptor for the selector: hold nothing
            sel = None
        held: dict[socket.socket, float] = {}
        while True:
            with self._cond:
                if not held and not self._queue and not self._closed:
                    self._cond.wait()
                new, self._queue = self._queue, []
                closed = self._closed
            for sock, until in new:
                if sel is None or closed:
                    self._forget(sock, sel=None)
                    continue
                sel.register(sock, selectors.EVENT_READ)
                held[sock] = until
            if closed and not held:
                break
            self._serve(sel, held, closed)
        if sel is not None:
            sel.close()

    def _serve(self, sel, held: dict, closed: bool) -> None:
        """Drain readable held sockets; close those at EOF, errored or past their hold time."""
        if not held:
            return
        now = time.monotonic()
        timeout = 0 if closed else max(0.0, min(0.05, min(held.values()) - now))
        done = [key.fileobj for key, _ in sel.select(timeout) if not _drain(key.fileobj)]
        now = time.monotonic()
        done += [s for s, until in held.items() if (closed or until <= now) and s not in done]
        for sock in done:
            held.pop(sock, None)
            self._forget(sock, sel)

    def _forget(self, sock: socket.socket, sel) -> None:
        if sel is not None:
            try:
                sel.unregister(sock)
            except (KeyError, ValueError):
                pass
        sock.close()
        with self._cond:
            self._held -= 1

    def close(self) -> None:
        """Close every held socket now (the thread ends). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)


def _drain(sock: socket.socket, limit: int = 1 << 20) -> bool:
    """Read and drop up to ``limit`` bytes a non-blocking ``sock`` has ready; False once the peer closed
    (EOF) or the socket failed, True while it may send more."""
    while limit > 0:
        try:
            got = sock.recv(min(limit, 1 << 16))
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not got:
            return False
        limit -= len(got)
    return True


class GuardedServerMixIn:
    """The limits for a ``socketserver.ThreadingMixIn`` server (a node's promote endpoint, the metrics
    endpoints). Put it first in the bases and call ``guard(...)`` in ``__init__`` before serving:

    * ``get_request``: accept() failing with EMFILE & co pauses the serve loop (AcceptBackoff), established
      connections keep being served on their threads;
    * ``process_request``: ConnGate caps; an over-limit peer gets ``refusal(reason)`` (the protocol's message,
      bytes) through a Refuser; a thread that cannot start refuses that connection only;
    * with ``timed_reads`` (a one-request protocol such as HTTP/1.0) a connection whose request has not been read
      in full ``frame_timeout_s`` after accept is shut down by ``service_actions`` (serve_forever calls it every
      poll interval); the handler calls ``request_read(request)`` once it has the whole request. Otherwise the
      handler times its frames itself (``count_idle`` / ``count_slow`` keep the numbers);
    * ``close_connections()`` ends every open connection (server_close never waits on a thread a peer holds).
    """

    block_on_close = False
    daemon_threads = True

    def guard(self, limits: ConnLimits, what: str, config_prefix: str, refusal, timed_reads: bool = False) -> None:
        """``what``: the server in log lines and refusals ("the promote endpoint of store node X");
        ``config_prefix``: prefix of its max_connections keys ("store.promote_"); ``refusal(reason) -> bytes``."""
        self.limits, self.guard_what, self._timed_reads, self._refusal = limits, what, timed_reads, refusal
        self.gate = ConnGate(limits, what, config_prefix)
        self.backoff = AcceptBackoff(what)
        self.refuser = Refuser(what)
        self.refusals = RefusalLog()
        self._guard_lock = threading.Lock()
        self._open: dict = {}  # socket -> (monotonic s its request started or None, peer)
        self.closed_idle = self.closed_slow = 0

    def guard_stats(self) -> dict[str, int]:
        """Connections open; refused over a cap; accept() failures survived; closed idle; closed slow."""
        with self._guard_lock:
            return {
                "connections": self.gate.total,
                "refused": self.gate.refused,
                "accept_failures": self.backoff.failures,
                "closed_idle": self.closed_idle,
                "closed_slow": self.closed_slow,
            }

    def get_request(self):
        try:
            got = super().get_request()
        except OSError as e:  # serve_forever skips this round and polls again
            if e.errno != errno.ECONNABORTED:
                time.sleep(self.backoff.failed(e))
            raise
        self.backoff.ok()
        return got

    def process_request(self, request, client_address) -> None:
        reason = self.gate.admit(client_address)
        if reason is not None:
            self.refusals.refused(f"connection to {self.guard_what}", client_address, reason)
            self.refuser.refuse(request, self._refusal(reason))
            return
        with self._guard_lock:
            self._open[request] = (time.monotonic() if self._timed_reads else None, client_address)
        try:
            super().process_request(request, client_address)
        except RuntimeError as e:  # can't start new thread: refuse this connection only
            with self._guard_lock:
                self._open.pop(request, None)
            self.gate.release(client_address)
            reason = f"{self.guard_what} has no thread to serve it ({e}); retry later"
            self.refusals.refused(f"connection to {self.guard_what}", client_address, reason)
            self.refuser.refuse(request, self._refusal(reason))

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.gate.release(client_address)

    def shutdown_request(self, request) -> None:
        with self._guard_lock:  # forgotten before it closes: the sweep never touches a reused fd
            self._open.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """A handler raised: a timeout counts as a slow peer; other socket errors are the peer's (debug log);
        anything else is logged with its traceback. The server keeps serving."""
        err = sys.exc_info()[1]
        if isinstance(err, TimeoutError):
            self.count_slow(
                client_address, f"a receive or send made no progress within {self.limits.frame_timeout_s * 1000:g} ms"
            )
        elif isinstance(err, OSError):
            log.debug("%s: connection from %s ended: %s", self.guard_what, client_address, err)
        else:
            log.exception("%s: request from %s failed", self.guard_what, client_address)

    def request_read(self, request) -> None:
        """The handler has its whole request: the connection is no longer timed by the sweep."""
        with self._guard_lock:
            if request in self._open:
                self._open[request] = (None, self._open[request][1])

    def service_actions(self) -> None:
        super().service_actions()
        limit, now, late = self.limits.frame_timeout_s, time.monotonic(), []
        with self._guard_lock:
            for sock, (since, peer) in self._open.items():
                if since is not None and now - since > limit:
                    self._open[sock] = (None, peer)
                    late.append(peer)
                    _shutdown(sock)
        for peer in late:
            self.count_slow(peer, f"its request did not arrive in full within {limit * 1000:g} ms")

    def count_idle(self) -> None:
        with self._guard_lock:
            self.closed_idle += 1

    def count_slow(self, peer, why: str) -> None:
        """A slow peer was dropped: counted, logged (rate-limited) with ``why``."""
        with self._guard_lock:
            self.closed_slow += 1
        self.refusals.refused(f"connection to {self.guard_what}", peer, f"{why}; closed")

    def close_connections(self) -> None:
        """End every open connection (their threads exit) and every held refusal."""
        with self._guard_lock:
            for sock in self._open:
                _shutdown(sock)
        self.refuser.close()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
