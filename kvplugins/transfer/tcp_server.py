"""The TCP transport's server. Python accepts, admits and authenticates connections; serving them is native
(kvplugins._tcp, native/src/tcp/server.cpp): epoll worker threads run the frame loop of every connection with
readv/sendmsg straight between the socket and the exported regions, without the GIL, so a busy Python
process keeps serving its peers. A control request (wire.OP_CONTROL) is the one frame handed back to Python
(its handler runs under the GIL). A malformed frame closes only its connection (reason logged); an
out-of-range entry is answered with an error status for that entry.

Lifecycle: ``TcpServer(...)`` binds and starts the accept thread and the events thread -> every exported region
of ``regions`` is mirrored into the native region table while registered (RegionTable.watch) -> ``close()``
stops accepting, ends every connection and joins the native workers.

Limits (issue #11; ``ConnLimits`` from TransferConfig.server_limits(), kvplugins/security/limits.py):
* accept() failing for lack of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) pauses accepting (logged,
  rate-limited) while established connections keep being served;
* over ``max_connections`` in all or ``max_connections_per_peer`` from one host, a new connection is answered
  with one refusal frame and closed: a response (wire.py) to request id 0, which no client sends, whose one
  status is the reason; the client (tcp.py) raises TransferFailed naming it;
* a connection with no request for ``idle_timeout_s`` is closed (clients reconnect transparently); a frame (or
  the handshake) started must arrive within ``frame_timeout_s`` and a reply must be taken within it too, else
  the connection is closed (slowloris, a peer that does not read).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any, Callable

from kvplugins.errors import KVPluginsError, ProtocolError
from kvplugins.security import RefusalLog, Secret, require_for_bind
from kvplugins.security.handshake import serve_blocking
from kvplugins.security.limits import AcceptBackoff, ConnGate, ConnLimits, Refuser
from kvplugins.transfer import native_tcp, wire
from kvplugins.transfer.memory import RegionTable

log = logging.getLogger("kvplugins.transfer.tcp")
REFUSAL_ID = 0  # the request id of a refusal frame (clients number their requests from 1)
EVENT_POLL_S = 0.5


class TcpServer:
    """Listens on (host, port); ``port`` is the bound port (port 0 picks a free one). ``limits``: connection
    caps and the idle and frame timeouts (module doc). ``threads``: native serving threads (0 = one per
    core, at most 4). With ``secret`` every connection must pass the handshake (kvplugins/security/handshake.py)
    before its first frame; a non-loopback ``host`` without one raises ConfigError."""

    def __init__(
        self,
        host: str,
        port: int,
        regions: RegionTable,
        max_frame: int,
        limits: ConnLimits,
        secret: Secret | None = None,
        threads: int = 0,
    ):
        require_for_bind(host, secret, "transfer host (store/client --host, KVPLUGINS_TRANSFER_HOST)")
        self._max_frame, self._limits = max_frame, limits
        self._frame_timeout = limits.frame_timeout_s
        self._secret, self._refusals = secret, RefusalLog()
        self._sock = socket.create_server((host, port), backlog=128)
        self.port = self._sock.getsockname()[1]
        what = f"the transfer server on port {self.port}"
        self._gate = ConnGate(limits, what, "transfer.")
        self._backoff = AcceptBackoff(what)
        self._refuser = Refuser(what)
        self._lock = threading.Lock()
        self._peers: dict[int, Any] = {}  # native connection id -> peer address
        self._closed_idle = self._closed_slow = 0
        self._closed = False
        self._controls: dict[str, Callable[[dict, Any], dict]] = {}
        self._native = native_tcp.Server(max_frame, limits, threads or min(4, os.cpu_count() or 1), _weak_control(self))
        self._unwatch = regions.watch(self._native.add_region, self._native.remove_region)
        self._events = threading.Thread(target=self._event_loop, name=f"kvp-tcp-events-{self.port}", daemon=True)
        self._events.start()
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"kvp-tcp-accept-{self.port}", daemon=True)
        self._acceptor.start()

    def set_control(self, kind: str, handler: "Callable[[dict, Any], dict]") -> None:
        """Serve control requests (wire.OP_CONTROL) of ``kind`` with ``handler(body, peer address) -> reply``,
        on a native worker thread holding the GIL, after the connection's handshake: another transport's
        connection set-up rides this authenticated server instead of a second one (the RDMA transport's QP
        exchange). A handler raising KVPluginsError or ValueError answers its message as the request's error
        status."""
        self._controls[kind] = handler

    def stats(self) -> dict[str, int]:
        """Connections open now; refused (over a cap); accept() failures survived; closed idle; closed slow; bytes
        staged between device regions and host memory for peers."""
        with self._lock:
            return {
                "connections": self._gate.total,
                "refused": self._gate.refused,
                "accept_failures": self._backoff.failures,
                "closed_idle": self._closed_idle,
                "closed_slow": self._closed_slow,
                "staged_bytes": self._native.staged_bytes(),
            }

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError as e:
                if self._closed:
                    return
                if e.errno != errno.ECONNABORTED:  # a peer gone before accept: just take the next one
                    time.sleep(self._backoff.failed(e))  # EMFILE...: wait for descriptors, serve the rest
                continue
            self._backoff.ok()
            self._admit(conn, addr)

    def _admit(self, conn: socket.socket, addr) -> None:
        """Hand ``conn`` to the native workers (after the handshake, on a short-lived thread, when there is a
        secret), or refuse it (over a cap, no thread to be had, closing)."""
        refusal = self._gate.admit(addr)
        if refusal is not None:
            self._refusals.refused("transfer connection", addr, refusal)
            self._refuser.refuse(conn, wire.encode_response(REFUSAL_ID, [refusal], 0))
            return
        if self._secret is None:
            self._adopt(conn, addr)
            return
        try:
            threading.Thread(target=self._authenticate, args=(conn, addr), name="kvp-tcp-auth", daemon=True).start()
        except RuntimeError as e:  # can't start new thread: refuse, keep serving the rest
            self._gate.release(addr)
            reason = f"the transfer server on port {self.port} has no thread to serve it ({e}); retry later"
            self._refusals.refused("transfer connection", addr, reason)
            self._refuser.refuse(conn, wire.encode_response(REFUSAL_ID, [reason], 0))

    def _adopt(self, conn: socket.socket, addr) -> None:
        with self._lock:
            if self._closed:
                self._gate.release(addr)
                conn.close()
                return
            try:
                cid = self._native.adopt(conn.detach())
            except KVPluginsError:  # closed meanwhile (the native side closed the fd)
                self._gate.release(addr)
                return
            self._peers[cid] = addr

    def _authenticate(self, conn: socket.socket, addr) -> None:
        """Run the handshake; a refused peer is logged and drained briefly (so it reads the refusal, not a reset)."""
        try:
            refused = serve_blocking(conn, self._secret, self._frame_timeout)
        except TimeoutError:
            refused = f"it did not authenticate within {self._frame_timeout:g} s"
            self._slow_count()
        except OSError as e:
            log.debug("transfer connection from %s ended during authentication: %s", addr, e)
            refused = ""
        if refused is None:
            self._adopt(conn, addr)
            return
        if refused:
            self._refusals.refused("transfer connection", addr, refused)
            _drain(conn, self._max_frame)
        conn.close()
        self._gate.release(addr)

    def _on_control(self, cid: int, header: bytes, payload_len: int) -> bytes:
        """A control request on connection ``cid`` (a native worker thread, holding the GIL): the response
        frame. Raises ProtocolError (malformed: the connection is closed with that reason)."""
        req = wire.decode_request(header, payload_len, self._max_frame)
        if req.op != wire.OP_CONTROL:
            raise ProtocolError(f"op {req.op} request decoded as control")
        with self._lock:
            addr = self._peers.get(cid)
        kind = req.control["kind"]
        handler = self._controls.get(kind)
        if handler is None:
            return wire.encode_response(
                req.req_id, [f"no {kind!r} control here (that transport is not offered by this process)"], 0
            )
        try:
            return wire.encode_response(req.req_id, [None], 0, handler(req.control, addr))
        except (KVPluginsError, ValueError) as e:
            return wire.encode_response(req.req_id, [f"{kind}: {e}"], 0)

    def _event_loop(self) -> None:
        """Connections the native workers closed: release their admission, count and log why."""
        while True:
            events = self._native.wait_events(EVENT_POLL_S)
            for cid, kind, reason in events:
                self._closed_conn(cid, kind, reason)
            if self._closed and not events:
                return

    def _closed_conn(self, cid: int, kind: int, reason: str) -> None:
        with self._lock:
            addr = self._peers.pop(cid, None)
        if addr is None:
            return
        self._gate.release(addr)
        if kind == native_tcp.PROTOCOL:
            log.warning("closing transfer connection from %s: %s", addr, reason)
        elif kind == native_tcp.SLOW:
            self._slow_count()
            self._refusals.refused(
                "transfer connection",
                addr,
                f"a frame (or its reply) did not complete within "
                f"{self._frame_timeout * 1000:g} ms (transfer.frame_timeout_ms); closed",
            )
        elif kind == native_tcp.IDLE:
            with self._lock:
                self._closed_idle += 1
            log.debug(
                "closing transfer connection from %s: no request for %g ms (transfer.idle_timeout_ms)",
                addr,
                self._limits.idle_timeout_s * 1000,
            )
        elif reason:
            log.debug("transfer connection from %s ended: %s", addr, reason)

    def _slow_count(self) -> None:
        with self._lock:
            self._closed_slow += 1

    def close(self) -> None:
        """Stop accepting and end every connection (the native workers are joined). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._refuser.close()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._unwatch()
        self._native.close()
        # joined, not left to die: a daemon thread still running at interpreter exit keeps this server (and its
        # native object) alive past finalization, which nanobind reports as a leak on stderr
        self._acceptor.join(timeout=2)
        self._events.join(timeout=2 * EVENT_POLL_S + 1)


def _weak_control(server: TcpServer):
    """The control callback the native server holds: a weak reference to ``server`` (a strong one would make a
    cycle through the native object that Python's garbage collector cannot see)."""
    ref = weakref.WeakMethod(server._on_control)

    def control(cid: int, header: bytes, payload_len: int) -> bytes:
        method = ref()
        if method is None:
            raise ProtocolError("the transfer server is closed")
        return method(cid, header, payload_len)

    return control


def _drain(conn: socket.socket, limit: int) -> None:
    """After a refusal: stop sending and read what the peer still sends for up to 1 s (so it reads the
    refusal instead of a reset)."""
    try:
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(0.2)
        deadline, left = time.monotonic() + 1.0, limit
        while left > 0 and time.monotonic() < deadline and (got := conn.recv(min(left, 1 << 16))):
            left -= len(got)
    except OSError:  # the peer went quiet or away: it had its answer
        pass
