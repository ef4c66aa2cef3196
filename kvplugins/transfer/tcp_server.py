"""The TCP transport's server: one accept thread, one thread per connection, serving reads and writes
into this process's exported regions. A malformed frame closes only its connection (reason logged);
an out-of-range entry is answered with an error status for that entry.

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
import select
import socket
import threading
import time
from typing import Any, Callable

from kvplugins.errors import KVPluginsError, OutOfRange, ProtocolError
from kvplugins.security import RefusalLog, Secret, require_for_bind
from kvplugins.security.handshake import serve_blocking
from kvplugins.security.limits import AcceptBackoff, ConnGate, ConnLimits, Refuser
from kvplugins.transfer import wire
from kvplugins.transfer.memory import RegionTable, view_of
from kvplugins.transfer.sockio import FrameReader, send_all

log = logging.getLogger("kvplugins.transfer.tcp")
REFUSAL_ID = 0          # the request id of a refusal frame (clients number their requests from 1)


class TcpServer:
    """Listens on (host, port); ``port`` is the bound port (port 0 picks a free one). ``limits``: connection
    caps and the idle and frame timeouts (module doc). With ``secret`` every connection must pass the handshake
    (kvplugins/security/handshake.py) before its first frame; a non-loopback ``host`` without one raises
    ConfigError."""

    def __init__(self, host: str, port: int, regions: RegionTable, max_frame: int, limits: ConnLimits,
                 secret: Secret | None = None):
        require_for_bind(host, secret, "transfer host (store/client --host, KVPLUGINS_TRANSFER_HOST)")
        self._regions, self._max_frame, self._limits = regions, max_frame, limits
        self._frame_timeout = limits.frame_timeout_s
        self._secret, self._refusals = secret, RefusalLog()
        self._sock = socket.create_server((host, port), backlog=128)
        self.port = self._sock.getsockname()[1]
        what = f"the transfer server on port {self.port}"
        self._gate = ConnGate(limits, what, "transfer.")
        self._backoff = AcceptBackoff(what)
        self._refuser = Refuser(what)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed_idle = self._closed_slow = 0
        self._closed = False
        self._controls: dict[str, Callable[[dict, Any], dict]] = {}
        threading.Thread(target=self._accept_loop, name=f"kvp-tcp-accept-{self.port}", daemon=True).start()

    def set_control(self, kind: str, handler: "Callable[[dict, Any], dict]") -> None:
        """Serve control requests (wire.OP_CONTROL) of ``kind`` with ``handler(body, peer address) -> reply``,
        on the connection's thread after its handshake: another transport's connection set-up rides this
        authenticated server instead of a second one (the RDMA transport's QP exchange). A handler raising
        KVPluginsError or ValueError answers its message as the request's error status."""
        self._controls[kind] = handler

    def stats(self) -> dict[str, int]:
        """Connections open now; refused (over a cap); accept() failures survived; closed idle; closed slow."""
        with self._lock:
            return {"connections": self._gate.total, "refused": self._gate.refused,
                    "accept_failures": self._backoff.failures, "closed_idle": self._closed_idle,
                    "closed_slow": self._closed_slow}

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError as e:
                if self._closed:
                    return
                if e.errno != errno.ECONNABORTED:      # a peer gone before accept: just take the next one
                    time.sleep(self._backoff.failed(e))  # EMFILE...: wait for descriptors, serve the rest
                continue
            self._backoff.ok()
            self._admit(conn, addr)

    def _admit(self, conn: socket.socket, addr) -> None:
        """Serve ``conn`` on its own thread, or refuse it (over a cap, no thread to be had, closing)."""
        refusal = self._gate.admit(addr)
        if refusal is not None:
            self._refusals.refused("transfer connection", addr, refusal)
            self._refuser.refuse(conn, wire.encode_response(REFUSAL_ID, [refusal], 0))
            return
        with self._lock:
            if self._closed:
                self._gate.release(addr)
                conn.close()
                return
            self._conns.add(conn)
        try:
            threading.Thread(target=self._serve, args=(conn, addr), name="kvp-tcp-conn", daemon=True).start()
        except RuntimeError as e:                       # can't start new thread: refuse, keep serving the rest
            with self._lock:
                self._conns.discard(conn)
            self._gate.release(addr)
            reason = f"the transfer server on port {self.port} has no thread to serve it ({e}); retry later"
            self._refusals.refused("transfer connection", addr, reason)
            self._refuser.refuse(conn, wire.encode_response(REFUSAL_ID, [reason], 0))

    def _forget(self, conn: socket.socket, addr) -> None:
        with self._lock:
            self._conns.discard(conn)
        self._gate.release(addr)
        conn.close()

    def _serve(self, conn: socket.socket, addr) -> None:
        reader = FrameReader()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self._frame_timeout)   # set once: no timeout toggling (2 syscalls) per frame
            if self._secret is not None and not self._authenticated(conn, addr):
                return
            poller = select.poll()
            poller.register(conn, select.POLLIN)
            while self._serve_one(conn, reader, poller, addr):
                pass
        except ProtocolError as e:
            log.warning("closing transfer connection from %s: %s", addr, e)
        except TimeoutError:
            self._slow(addr)
        except OSError as e:
            log.debug("transfer connection from %s ended: %s", addr, e)
        finally:
            self._forget(conn, addr)

    def _slow(self, addr) -> None:
        """A frame, handshake or reply did not complete within frame_timeout_s: counted, logged rate-limited."""
        with self._lock:
            self._closed_slow += 1
        self._refusals.refused("transfer connection", addr, f"a frame (or its reply) did not complete within "
                               f"{self._frame_timeout * 1000:g} ms (transfer.frame_timeout_ms); closed")

    def _authenticated(self, conn: socket.socket, addr) -> bool:
        """Run the handshake; a refused peer is logged and drained briefly (so it reads the refusal, not a reset)."""
        try:
            refused = serve_blocking(conn, self._secret, self._frame_timeout)
        except TimeoutError:
            self._refusals.refused("transfer connection", addr, f"it did not authenticate within "
                                   f"{self._frame_timeout:g} s")
            return False
        if refused is None:
            return True
        self._refusals.refused("transfer connection", addr, refused)
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(0.2)
        deadline, left = time.monotonic() + 1.0, self._max_frame
        try:
            while left > 0 and time.monotonic() < deadline and (got := conn.recv(min(left, 1 << 16))):
                left -= len(got)
        except OSError:                 # the peer went quiet or away: it had its answer
            pass
        return False

    def _serve_one(self, conn: socket.socket, reader: FrameReader, poller, addr) -> bool:
        """Serve one request frame; False when the peer closed between frames or idled past idle_timeout_s.
        From its first byte, a frame and its reply must complete within frame_timeout_s (every receive
        and send must progress within it, and the frame's deadline is checked after each). Raises
        ProtocolError, TimeoutError (slow), OSError."""
        if not reader.buffered() and not self._request_within(poller, addr):
            return False
        deadline = time.monotonic() + self._frame_timeout
        if not reader.fill(conn, wire.PREFIX.size, deadline, idle_ok=True):
            return False
        hlen, plen = wire.parse_prefix(reader.take(wire.PREFIX.size), self._max_frame)
        reader.fill(conn, hlen, deadline)
        req = wire.decode_request(reader.take(hlen), plen, self._max_frame)
        if req.op == wire.OP_CONTROL:
            send_all(conn, [self._control(req, addr)], deadline)
            return True
        status, addrs, _pins = self._resolve(req)  # _pins keeps the memory mapped until we return
        if req.op == wire.OP_WRITE:  # a rejected entry's bytes land in scratch (bounded by max_frame)
            reader.read_into(conn, [view_of(a, e[2]) if a is not None else bytearray(e[2])
                                    for e, a in zip(req.entries, addrs)], deadline)
            send_all(conn, [wire.encode_response(req.req_id, status, 0)], deadline)
        else:
            views = [view_of(a, e[2]) for e, a in zip(req.entries, addrs) if a is not None]
            head = wire.encode_response(req.req_id, status, sum(len(v) for v in views))
            send_all(conn, [head, *views], deadline)
        return True

    def _control(self, req: wire.Request, addr) -> bytes:
        """The response frame to control request ``req``: the handler's reply, or its error as the status."""
        kind = req.control["kind"]
        handler = self._controls.get(kind)
        if handler is None:
            return wire.encode_response(req.req_id, [f"no {kind!r} control here (that transport is not "
                                                     f"offered by this process)"], 0)
        try:
            return wire.encode_response(req.req_id, [None], 0, handler(req.control, addr))
        except (KVPluginsError, ValueError) as e:
            return wire.encode_response(req.req_id, [f"{kind}: {e}"], 0)

    def _request_within(self, poller, addr) -> bool:
        """Wait for the next request's first byte (or EOF, or close()); False after idle_timeout_s without
        one (0 = wait forever)."""
        idle = self._limits.idle_timeout_s
        if poller.poll(max(1, int(idle * 1000)) if idle else None):
            return True
        with self._lock:
            self._closed_idle += 1
        log.debug("closing transfer connection from %s: no request for %g ms (transfer.idle_timeout_ms)",
                  addr, idle * 1000)
        return False

    def _resolve(self, req: wire.Request) -> tuple[list[str | None], list[int | None], list]:
        """Per entry: error text or None, address or None; plus pins to hold while serving."""
        status: list[str | None] = []
        addrs: list[int | None] = []
        pins = []
        for region, offset, length in req.entries:
            try:
                addr, pin = self._regions.resolve_exported(region, offset, length, req.op == wire.OP_WRITE)
                addrs.append(addr)
                pins.append(pin)
                status.append(None)
            except OutOfRange as e:
                addrs.append(None)
                status.append(str(e))
        return status, addrs, pins

    def close(self) -> None:
        """Stop accepting and end every connection (their threads exit). Idempotent."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        self._refuser.close()
        for s in [self._sock, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._sock.close()
