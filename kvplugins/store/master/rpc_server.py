"""Serves MasterService on two endpoints from one single-threaded selector (epoll) loop.

* raw endpoint (``host:port``, the master address): length-prefixed msgpack frames over TCP, used by clients on
  the per-operation path (~20 µs round trip here).
* zmq ROUTER endpoint (reported by the ``info`` op): the control plane — node registration, heartbeats,
  ``kvplugins status`` (~115 µs round trip; fine off the hot path).
Both run the same dispatcher (kvplugins/store/protocol.py). A bad raw frame (wrong version, too large, not
msgpack) closes that connection with a logged reason; a bad zmq message is logged and dropped.
The periodic sweep (service.tick) runs every ``tick_ms`` in the same loop, so the logic needs no locks.
The zmq socket joins the selector through its edge-triggered ZMQ_FD: when it fires (and on every tick) the
ROUTER is drained while zmq.EVENTS reports input; plain sockets are level-triggered.
"""
from __future__ import annotations

import gc
import logging
import selectors
import socket
import time

import zmq

from kvplugins import security
from kvplugins.errors import ProtocolError
from kvplugins.security.curve import CurveServer
from kvplugins.store import protocol
from kvplugins.store.config import MasterConfig
from kvplugins.store.ha import group_commit
from kvplugins.store.master.service import MasterService
from kvplugins.store.metrics import MasterMetrics

log = logging.getLogger(__name__)
RECV_CHUNK = 1 << 16          # below malloc's mmap threshold: a 1 MiB recv buffer costs ~20 µs per call
# The object table holds millions of small objects; with CPython's default gen-0 threshold (700) the collector
# walks them so often that put_start costs 2x (12 vs 5-6 µs per key measured). The master's objects form no
# cycles on the hot path, so collections may be rare. Applied by serve_forever (the master's process).
GC_THRESHOLDS = (50_000, 20, 20)


class _Conn:
    def __init__(self, sock: socket.socket, peer):
        self.sock, self.peer = sock, peer
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.writing = False          # registered for EVENT_WRITE
        self.guard = None             # security.ServerHandshake until the peer has authenticated


class RpcServer:
    """Bind both endpoints (port 0 = any) and serve ``service`` until ``stop()``."""

    def __init__(self, config: MasterConfig, service: MasterService | None = None):
        self.cfg = config
        self._secret = security.resolve()   # shared secret: both endpoints authenticate (kvplugins/security)
        security.require_for_bind(config.host, self._secret, "master --host")
        self._refusals = security.RefusalLog()
        self._listener = socket.create_server((config.host, config.port), reuse_port=False)
        self._listener.setblocking(False)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._curve = CurveServer(self._router, self._secret) if self._secret else None
        if config.zmq_port:
            self._router.bind(f"tcp://{config.host}:{config.zmq_port}")
        else:
            self._router.bind_to_random_port(f"tcp://{config.host}")
        self.zmq_endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.service = service or MasterService(config, zmq_endpoint=self.zmq_endpoint)
        self.service.zmq_endpoint = self.zmq_endpoint
        self.metrics = MasterMetrics(self, config)      # op latency timer; /metrics if metrics_port >= 0
        self._group = group_commit.for_server(self)     # HA master: replies wait for their etcd writes
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._router.getsockopt(zmq.FD), selectors.EVENT_READ, "zmq")
        self._conns: dict[int, _Conn] = {}
        self._stopped = False

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def stop(self) -> None:
        """Ask serve_forever to return (safe from a signal handler or another thread)."""
        self._stopped = True

    def serve_forever(self) -> None:
        gc.set_threshold(*GC_THRESHOLDS)
        tick_s = self.cfg.tick_ms / 1000
        next_tick = time.monotonic() + tick_s
        try:
            while not self._stopped:
                for key, ev in self._sel.select(max(0.0, next_tick - time.monotonic())):
                    self._on_event(key, ev)
                if time.monotonic() >= next_tick:
                    self._on_zmq()                   # safety net for the edge-triggered ZMQ_FD
                    self.service.tick()
                    self._drop_unauthenticated()
                    self.metrics.publish()           # snapshot for the metrics thread
                    next_tick = time.monotonic() + tick_s
                if self._group is not None:
                    self._group.sync()               # persist this turn's metadata, then send its replies
        finally:
            self.close()

    def close(self) -> None:
        self.metrics.close()
        for conn in list(self._conns.values()):
            self._drop(conn, None)
        self._sel.close()
        self._listener.close()
        if self._curve is not None:
            self._curve.close()
        self._router.close(0)
        self._ctx.term()

    # ---- dispatch ------------------------------------------------------------------------------------
    def _answer(self, body: bytes) -> bytes:
        """Response body for one request body. Raises ProtocolError for a malformed request."""
        rid, op, entries, opts = protocol.parse_request(protocol.unpack(body))
        t0 = time.perf_counter()
        try:
            payload, ok = self.service.handle(op, entries, opts), True
        except (ValueError, TypeError, KeyError) as e:
            payload, ok = f"{op}: {e}", False
        except Exception as e:  # noqa: BLE001 - a logic bug answers this request; the master keeps serving
            log.exception("op %s failed", op)
            payload, ok = f"{op}: internal error {e!r}", False
        if ok:
            self.metrics.timer.record(op, time.perf_counter() - t0)
        return protocol.pack([protocol.VERSION, rid, ok, payload])

    def _on_event(self, key, ev: int) -> None:
        conn = key.data
        if conn == "zmq":
            self._on_zmq()
        elif conn is None:
            self._accept()
        elif conn.sock.fileno() in self._conns:
            if ev & selectors.EVENT_READ:
                self._on_readable(conn)
            if ev & selectors.EVENT_WRITE and conn.sock.fileno() in self._conns and not (
                    self._group is not None and self._group.holds(conn)):
                self._flush(conn)

    def _on_zmq(self) -> None:
        """Drain the ROUTER; reading zmq.EVENTS each turn also re-arms its edge-triggered FD."""
        while self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = self._answer(parts[-1])
            except ProtocolError as e:
                log.warning("dropped zmq message from %r: %s", parts[0], e)
                continue
            if self._group is not None:
                self._group.send_zmq(parts[:-1] + [reply])
            else:
                self._router.send_multipart(parts[:-1] + [reply])

    # ---- raw endpoint --------------------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, peer = self._listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, peer)
        conn.guard = security.ServerHandshake(self._secret) if self._secret else None
        self._conns[sock.fileno()] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            return self._drop(conn, f"recv failed: {e}")
        if not data:
            return self._drop(conn, None)
        conn.inbuf += data
        if conn.guard is not None and not self._authenticate(conn):
            return
        try:
            self._serve_frames(conn)
        except ProtocolError as e:
            return self._drop(conn, str(e))
        if self._group is not None:
            return self._group.hold(conn)
        self._flush(conn)

    def _authenticate(self, conn: _Conn) -> bool:
        """Feed a not yet authenticated connection's bytes to its handshake; True once it has passed."""
        out, outcome = conn.guard.feed(conn.inbuf)
        conn.outbuf += out
        if outcome is None:
            self._flush(conn)
        elif outcome is False:
            self._flush(conn)
            self._refusals.refused("master RPC connection", conn.peer, conn.guard.reason)
            self._drop(conn, None)
        else:
            conn.guard = None
        return outcome is True

    def _drop_unauthenticated(self) -> None:
        """Close connections still not authenticated after handshake.DEADLINE_S (they hold a descriptor)."""
        if self._secret is None:
            return
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.guard is not None and c.guard.overdue(now)]:
            self._refusals.refused("master RPC connection", conn.peer, conn.guard.reason)
            self._drop(conn, None)

    def _serve_frames(self, conn: _Conn) -> None:
        hdr = protocol.HEADER.size
        while len(conn.inbuf) >= hdr:
            (n,) = protocol.HEADER.unpack_from(conn.inbuf)
            if n > self.cfg.max_frame:
                raise ProtocolError(f"frame of {n} bytes exceeds max_frame {self.cfg.max_frame}")
            if len(conn.inbuf) < hdr + n:
                return
            body = bytes(conn.inbuf[hdr:hdr + n])
            del conn.inbuf[:hdr + n]
            reply = self._answer(body)
            conn.outbuf += protocol.HEADER.pack(len(reply)) + reply

    def _flush(self, conn: _Conn) -> None:
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                return self._drop(conn, f"send failed: {e}")
        if bool(conn.outbuf) != conn.writing:      # watch for writability only while bytes wait
            conn.writing = bool(conn.outbuf)
            self._sel.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0),
                             conn)

    def _drop(self, conn: _Conn, reason: str | None) -> None:
        if reason:
            log.warning("closed connection from %s: %s", conn.peer, reason)
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
