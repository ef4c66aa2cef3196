"""The TCP transport's server: one accept thread, one thread per connection, serving reads and writes
into this process's exported regions. A malformed frame closes only its connection (reason logged);
an out-of-range entry is answered with an error status for that entry."""
from __future__ import annotations

import logging
import socket
import threading
import time

from kvplugins.errors import OutOfRange, ProtocolError
from kvplugins.security import RefusalLog, Secret, require_for_bind
from kvplugins.security.handshake import serve_blocking
from kvplugins.transfer import wire
from kvplugins.transfer.memory import RegionTable, view_of
from kvplugins.transfer.sockio import FrameReader, send_all

log = logging.getLogger("kvplugins.transfer.tcp")


class TcpServer:
    """Listens on (host, port); ``port`` is the bound port (port 0 picks a free one). A connection may idle
    between frames forever, but a frame started must complete within ``frame_timeout_s``. With ``secret`` every
    connection must pass the handshake (kvplugins/security/handshake.py) before its first frame; a non-loopback
    ``host`` without one raises ConfigError."""

    def __init__(self, host: str, port: int, regions: RegionTable, max_frame: int, frame_timeout_s: float,
                 secret: Secret | None = None):
        require_for_bind(host, secret, "transfer host (store/client --host, KVPLUGINS_TRANSFER_HOST)")
        self._regions, self._max_frame, self._frame_timeout = regions, max_frame, frame_timeout_s
        self._secret, self._refusals = secret, RefusalLog()
        self._sock = socket.create_server((host, port), backlog=128)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept_loop, name=f"kvp-tcp-accept-{self.port}", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError as e:
                if self._closed:
                    return
                log.warning("transfer server on port %d: accept failed (%s); retrying", self.port, e)
                time.sleep(0.05)  # e.g. EMFILE: wait for descriptors to free instead of spinning or dying
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, addr), name="kvp-tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, addr) -> None:
        reader = FrameReader()
        try:
            if self._secret is not None and not self._authenticated(conn, addr):
                return
            conn.settimeout(self._frame_timeout)   # set once: no timeout toggling (2 syscalls) per frame
            while self._serve_one(conn, reader):
                pass
        except ProtocolError as e:
            log.warning("closing transfer connection from %s: %s", addr, e)
        except OSError as e:
            log.debug("transfer connection from %s ended: %s", addr, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

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
        while left > 0 and time.monotonic() < deadline and (got := conn.recv(min(left, 1 << 16))):
            left -= len(got)
        return False

    def _serve_one(self, conn: socket.socket, reader: FrameReader) -> bool:
        """Serve one request frame; False when the peer closed cleanly between frames. Between frames the
        connection may idle forever; within a frame every receive must progress within frame_timeout_s."""
        while True:
            try:
                if not reader.fill(conn, wire.PREFIX.size, idle_ok=True):
                    return False
                break
            except TimeoutError:
                if reader.buffered():
                    raise               # a frame started and stalled
                if self._closed:
                    return False
        deadline = time.monotonic() + self._frame_timeout
        hlen, plen = wire.parse_prefix(reader.take(wire.PREFIX.size), self._max_frame)
        reader.fill(conn, hlen, deadline)
        req = wire.decode_request(reader.take(hlen), plen, self._max_frame)
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
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for s in [self._sock, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._sock.close()
