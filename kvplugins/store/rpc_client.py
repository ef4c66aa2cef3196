"""Clients of the master's two endpoints. Every call has a timeout and raises MasterUnreachable (naming the
address and the timeout) instead of hanging; after a failure the connection is rebuilt on the next call.

RawRpcClient: the per-operation path (length-prefixed msgpack over TCP). ZmqRpcClient: the control plane
(node registration/heartbeats, status). Both are thread-safe (one call in flight per client).
"""
from __future__ import annotations

import itertools
import socket
import threading
import time

from kvplugins.errors import ConfigError, MasterUnreachable, ProtocolError, StoreError
from kvplugins.store import protocol

RECV_CHUNK = 1 << 16


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' (optionally 'tcp://host:port') -> (host, port). Raises ConfigError."""
    text = address.removeprefix("tcp://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"master address {address!r} must be host:port, e.g. 127.0.0.1:5555")
    return host.strip("[]"), int(port)


class _Base:
    def __init__(self, address: str, timeout_ms: float):
        self.address, self.timeout_ms = address, timeout_ms
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def call(self, op: str, entries=(), opts: dict | None = None, timeout_ms: float | None = None):
        """Run batch op ``op`` on the master; returns its payload.
        Raises MasterUnreachable (no answer in time), StoreError (the master refused the request)."""
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        rid = next(self._ids)
        body = protocol.pack([protocol.VERSION, rid, op, list(entries), opts or {}])
        with self._lock:
            try:
                reply = self._roundtrip(body, time.monotonic() + timeout / 1000)
                ok, payload = protocol.parse_response(protocol.unpack(reply), rid)
            except (OSError, ProtocolError, TimeoutError) as e:
                self._reset()
                raise MasterUnreachable(self.address, timeout, f"{op}: {e or type(e).__name__}") from e
        if not ok:
            raise StoreError(f"master {self.address} refused {op}: {payload}")
        return payload

    def close(self) -> None:
        with self._lock:
            self._reset()


class RawRpcClient(_Base):
    """Length-prefixed msgpack frames over one TCP connection to the master address ``host:port``."""

    def __init__(self, address: str, timeout_ms: float):
        super().__init__(address, timeout_ms)
        self._host, self._port = parse_address(address)
        self._sock: socket.socket | None = None

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self, deadline: float) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection((self._host, self._port), timeout=_left(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _roundtrip(self, body: bytes, deadline: float) -> bytes:
        sock = self._connect(deadline)
        sock.settimeout(_left(deadline))
        sock.sendall(protocol.HEADER.pack(len(body)) + body)
        buf = self._recv_some(sock, deadline, first=True)       # usually the whole reply in one recv
        while len(buf) < protocol.HEADER.size:
            buf += self._recv_some(sock, deadline)
        (n,) = protocol.HEADER.unpack_from(buf)
        end = protocol.HEADER.size + n
        while len(buf) < end:
            buf += self._recv_some(sock, deadline)
        if len(buf) > end:
            raise ProtocolError(f"{len(buf) - end} unexpected bytes after the reply")
        return bytes(buf[protocol.HEADER.size:end])

    @staticmethod
    def _recv_some(sock: socket.socket, deadline: float, first: bool = False) -> bytes:
        if not first:
            sock.settimeout(_left(deadline))
        chunk = sock.recv(RECV_CHUNK)
        if not chunk:
            raise ConnectionError("master closed the connection")
        return chunk


class ZmqRpcClient(_Base):
    """A zmq DEALER connected to the master's ROUTER endpoint (``tcp://host:port`` from the ``info`` op)."""

    def __init__(self, endpoint: str, timeout_ms: float):
        super().__init__(endpoint, timeout_ms)
        import zmq
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sock = None

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def _roundtrip(self, body: bytes, deadline: float) -> bytes:
        zmq = self._zmq
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.address)
        self._sock.send(body)
        if not self._sock.poll(int(_left(deadline) * 1000), zmq.POLLIN):
            raise TimeoutError("no reply")
        return self._sock.recv()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def control_client(address: str, timeout_ms: float) -> ZmqRpcClient:
    """A zmq control-plane client for the master whose raw address is ``address`` (asks ``info``)."""
    raw = RawRpcClient(address, timeout_ms)
    try:
        endpoint = raw.call("info")["zmq"]
    finally:
        raw.close()
    return ZmqRpcClient(endpoint, timeout_ms)
