"""The node's promote endpoint: the master's raw frame format (protocol.py: 4-byte length + msgpack
``[VERSION, id, op, entries, opts]`` -> ``[VERSION, id, ok, payload]``; never pickle) on a TCP port of the node,
one thread per connection. A client reaches it with rpc_client.RawRpcClient. Ops: ``promote`` (keys -> per key
``[code, detail]``). Off the per-operation path: only gets of disk-resident objects come here. With a shared
secret configured (kvplugins/security) every connection must pass its handshake first, as on the master's raw
endpoint; binding a non-loopback address without one raises ConfigError.
"""
from __future__ import annotations

import logging
import socket
import socketserver
import threading

from kvplugins import security
from kvplugins.errors import ProtocolError
from kvplugins.security import handshake
from kvplugins.store import protocol

log = logging.getLogger(__name__)
MAX_FRAME = 16 << 20
AUTH_TIMEOUT_S = 5.0


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self.server.secret is not None:
                reason = handshake.serve_blocking(sock, self.server.secret, AUTH_TIMEOUT_S)
                if reason is not None:
                    return self.server.refusals.refused("disk-tier promote connection", self.client_address, reason)
                sock.settimeout(None)
            while (body := _recv_frame(sock)) is not None:
                sock.sendall(protocol.frame(self.server.answer(body)))
        except (OSError, ProtocolError) as e:
            log.info("promote endpoint: closed connection from %s: %s", self.client_address, e or type(e).__name__)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, ops: dict):
        self.secret = security.resolve()
        security.require_for_bind(host, self.secret, "store --host (the disk tier's promote endpoint)")
        self.refusals = security.RefusalLog()
        super().__init__((host, 0), _Handler)
        self.ops = ops

    def answer(self, body: bytes) -> list:
        rid, op, entries, opts = protocol.parse_request(protocol.unpack(body))
        fn = self.ops.get(op)
        if fn is None:
            return [protocol.VERSION, rid, False, f"unknown op {op!r}; valid: {', '.join(sorted(self.ops))}"]
        try:
            return [protocol.VERSION, rid, True, fn(entries, opts)]
        except Exception as e:  # noqa: BLE001 - answer the request, keep serving
            log.exception("promote endpoint: op %s failed", op)
            return [protocol.VERSION, rid, False, f"{op}: {e!r}"]


class OpServer:
    """Serve ``ops`` (name -> fn(entries, opts) -> payload) on ``host``:0 in a background thread."""

    def __init__(self, host: str, ops: dict):
        self._server = _Server(host, ops)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="kvp-disk-endpoint", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _recv_frame(sock: socket.socket) -> bytes | None:
    head = _recv_exact(sock, protocol.HEADER.size)
    if head is None:
        return None
    (n,) = protocol.HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    body = _recv_exact(sock, n)
    if body is None:
        raise ProtocolError("connection closed inside a frame")
    return body


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise ProtocolError(f"connection closed after {len(buf)} of {n} bytes")
            return None
        buf += chunk
    return bytes(buf)
