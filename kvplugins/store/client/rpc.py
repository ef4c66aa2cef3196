"""Clients of the master's two endpoints. Every call has a timeout and raises MasterUnreachable (naming the
address and the timeout) instead of hanging; after a failure the connection is rebuilt on the next call.

RawRpcClient: the per-operation path (length-prefixed msgpack over TCP). ZmqRpcClient: the control plane
(node registration/heartbeats, status). Both are thread-safe (one call in flight per client). Each connects as
one ``role`` (security/roles.py: client, node or admin), fixed when it authenticates; an op outside it raises
Forbidden naming the role needed.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time

import zmq

from kvplugins import security
from kvplugins.errors import ConfigError, Forbidden, MasterUnreachable, ProtocolError, StoreError
from kvplugins.security import curve, handshake
from kvplugins.security.roles import FORBIDDEN
from kvplugins.store.wire import protocol
from kvplugins.transfer.sockio import reusable

RECV_CHUNK = 1 << 16
IDLE_CHECK_S = 1.0  # a connection unused this long is checked for a close by the master before reuse
RECONNECT_IVL_MS = 100  # ZMQ_RECONNECT_IVL of a control-plane socket (libzmq's default); tests shorten it


def parse_address(address: str, what: str = "master address", example: str = "127.0.0.1:5555") -> tuple[str, int]:
    """'host:port' (optionally 'tcp://host:port'; '[v6]:port') -> (host, port). Raises ConfigError naming
    ``what`` it is and an ``example``."""
    text = address.removeprefix("tcp://") if isinstance(address, str) else ""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 1 << 16:
        raise ConfigError(f"{what} {address!r} must be host:port with a port in 1-65535, e.g. {example}")
    return host.strip("[]"), int(port)


class _Base:
    def __init__(self, address: str, timeout_ms: float, role: str = "client"):
        self.address, self.timeout_ms, self.role = address, timeout_ms, role
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._secret = security.resolve()  # the cluster's shared secret: authenticate each connection once

    def call(self, op: str, entries=(), opts: dict | None = None, timeout_ms: float | None = None):
        """Run batch op ``op`` on the master; returns its payload.
        Raises MasterUnreachable (no answer in time), Forbidden (``op`` is outside this client's role), AuthError
        (the master refused this process's credential), StoreError (the master refused the request)."""
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
        return self._accepted(op, ok, payload)

    def _accepted(self, op: str, ok: bool, payload):
        """``payload`` of a reply the master answered with ``ok``. Raises Forbidden or StoreError for a refusal."""
        if not ok:
            if type(payload) is str and payload.startswith(FORBIDDEN):
                raise Forbidden(f"master {self.address} refused {op}: {payload.removeprefix(FORBIDDEN)}")
            raise StoreError(f"master {self.address} refused {op}: {payload}")
        return payload

    def close(self) -> None:
        with self._lock:
            self._reset()


class RawRpcClient(_Base):
    """Length-prefixed msgpack frames over one TCP connection to the master address ``host:port``.

    ``send_deferred`` pipelines a request: it is sent at once and its reply is read later, in order, before
    the reply of the next ``call`` on this connection, or by ``flush``/``close``. The master serves one
    connection's frames in order, so anything this client asks after a deferred request sees its effect.
    At most MAX_DEFERRED replies wait; more make the send flush first."""

    MAX_DEFERRED = 64

    def __init__(self, address: str, timeout_ms: float, role: str = "client"):
        super().__init__(address, timeout_ms, role)
        self._host, self._port = parse_address(address)
        self._sock: socket.socket | None = None
        self._rbuf = bytearray()
        self._deferred: list[tuple[int, str, object]] = []  # (request id, op, on_reply)
        self._used = 0.0  # when a request last went out (monotonic s)

    def send_deferred(self, op: str, entries=(), opts: dict | None = None, on_reply=None) -> None:
        """Send ``op`` now without waiting; ``on_reply(ok, payload)`` runs when its reply is read (or with
        (False, reason) if the connection fails first). Raises MasterUnreachable if it cannot be sent."""
        rid = next(self._ids)
        body = protocol.pack([protocol.VERSION, rid, op, list(entries), opts or {}])
        with self._lock:
            deadline = time.monotonic() + self.timeout_ms / 1000
            try:
                if len(self._deferred) >= self.MAX_DEFERRED:
                    self._drain(deadline)
                self._send(body, deadline)
            except (OSError, ProtocolError, TimeoutError) as e:
                self._reset()
                raise MasterUnreachable(self.address, self.timeout_ms, f"{op}: {e or type(e).__name__}") from e
            self._deferred.append((rid, op, on_reply))

    def held(self, op: str, timeout_ms: float | None = None) -> "Held":
        """This connection for one native exchange of ``op`` (a request sent and its reply read by native code on
        the socket: kvplugins.native.get_many), as a context manager: entering takes this client's lock, connects
        (authenticated) and reads the deferred replies; raises MasterUnreachable when it cannot."""
        return Held(self, op, self.timeout_ms if timeout_ms is None else timeout_ms)

    def _ready(self, op: str, timeout: float) -> tuple[int, float]:
        """(socket fd, ms left) of the connection made ready for a native exchange; call with the lock held."""
        deadline = time.monotonic() + timeout / 1000
        try:
            if self._deferred:
                self._sock.settimeout(_left(deadline))
                self._drain(deadline)
            sock = self._connect(deadline)
            if self._rbuf:
                raise ProtocolError(f"{len(self._rbuf)} bytes from the master that no request asked for")
            return sock.fileno(), _left(deadline) * 1000
        except (OSError, ProtocolError, TimeoutError) as e:
            self._reset()
            raise MasterUnreachable(self.address, timeout, f"{op}: {e or type(e).__name__}") from e

    def flush(self, timeout_ms: float | None = None) -> None:
        """Read the replies of every deferred request. Raises MasterUnreachable (those requests are then
        reported to their on_reply as failed)."""
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        with self._lock:
            if not self._deferred:
                return
            try:
                deadline = time.monotonic() + timeout / 1000
                self._sock.settimeout(_left(deadline))
                self._drain(deadline)
            except (OSError, ProtocolError, TimeoutError) as e:
                self._reset()
                raise MasterUnreachable(self.address, timeout, f"flush: {e or type(e).__name__}") from e

    def _reset(self) -> None:
        deferred, self._deferred = self._deferred, []
        self._rbuf.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for _, op, on_reply in deferred:
            if on_reply is not None:
                on_reply(False, f"{op}: connection to the master lost before its reply")

    def _connect(self, deadline: float) -> socket.socket:
        if (
            self._sock is not None
            and not self._deferred
            and time.monotonic() - self._used > IDLE_CHECK_S
            and not reusable(self._sock)
        ):
            self._reset()  # the master closed it while idle (master.idle_timeout_ms): reconnect
        self._used = time.monotonic()
        if self._sock is None:
            sock = socket.create_connection((self._host, self._port), timeout=_left(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._secret is not None:
                handshake.client(
                    sock, self._secret, deadline, f"master {self.address}", self.role, refused=_refusal_frame
                )
            self._sock = sock
        return self._sock

    def _send(self, body: bytes, deadline: float) -> None:
        sock = self._connect(deadline)
        sock.settimeout(_left(deadline))
        sock.sendall(protocol.HEADER.pack(len(body)) + body)

    def _roundtrip(self, body: bytes, deadline: float) -> bytes:
        self._send(body, deadline)
        self._drain(deadline)
        return self._recv_frame(deadline)

    def _drain(self, deadline: float) -> None:
        """Read the replies of the deferred requests, in order."""
        while self._deferred:
            rid, op, on_reply = self._deferred[0]
            ok, payload = protocol.parse_response(protocol.unpack(self._recv_frame(deadline)), rid)
            self._deferred.pop(0)
            if on_reply is not None:
                on_reply(ok, payload)

    def _recv_frame(self, deadline: float) -> bytes:
        buf, hdr = self._rbuf, protocol.HEADER.size
        while len(buf) < hdr or len(buf) < hdr + protocol.HEADER.unpack_from(buf)[0]:
            self._recv_some(deadline)
        end = hdr + protocol.HEADER.unpack_from(buf)[0]
        body = bytes(buf[hdr:end])
        del buf[:end]
        return body

    def _recv_some(self, deadline: float) -> None:
        _left(deadline)  # the socket timeout was set to the time left when the request was sent
        chunk = self._sock.recv(RECV_CHUNK)
        if not chunk:
            handshake.check_refused(self._rbuf, f"master {self.address}")  # AuthError if it refused us
            raise ConnectionError("master closed the connection")
        self._rbuf += chunk


class Held:
    """One native exchange on a RawRpcClient's connection (RawRpcClient.held), inside ``with``: socket ``fd``,
    request id ``rid``, ``ms`` left for it."""

    def __init__(self, client: RawRpcClient, op: str, timeout_ms: float):
        self.client, self.op, self.timeout_ms = client, op, timeout_ms
        self.rid = next(client._ids)
        self.fd, self.ms = -1, 0.0

    def __enter__(self) -> "Held":
        self.client._lock.acquire()
        try:
            self.fd, self.ms = self.client._ready(self.op, self.timeout_ms)
        except BaseException:
            self.client._lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.client._lock.release()

    def payload(self, body: bytes):
        """The payload of reply ``body``, checked as call checks it. Raises MasterUnreachable (a malformed reply:
        the connection is closed), Forbidden, StoreError (a refusal)."""
        try:
            ok, payload = protocol.parse_response(protocol.unpack(body), self.rid)
        except ProtocolError as e:
            raise self.failed(e) from e
        return self.client._accepted(self.op, ok, payload)

    def failed(self, err: Exception) -> MasterUnreachable:
        """The exchange failed with ``err`` (its OSError or TimeoutError): the connection is closed (bytes may be in
        flight); returns the MasterUnreachable to raise."""
        self.client._reset()
        return MasterUnreachable(self.client.address, self.timeout_ms, f"{self.op}: {err or type(err).__name__}")


class ZmqRpcClient(_Base):
    """A zmq DEALER connected to the master's ROUTER endpoint (``tcp://host:port`` from the ``info`` op).

    Until its first reply, a socket carries a monitor of failed CURVE handshakes, read when a call times out to
    tell a refusal (AuthError) from silence. After it, the monitor goes: libzmq keeps reconnecting an idle socket,
    and where its master's port came to answer with other keys, every reconnect's failure was queued on the unread
    monitor until, at the pipe's high-water mark (~2,000 events, ~200 s at the 100 ms reconnect interval), the
    shared context's I/O thread blocked on the next one, and every control-plane call of the process got no reply.
    The monitor is stopped (disable_monitor) before either socket closes, so no event is sent to a closed reader."""

    def __init__(self, endpoint: str, timeout_ms: float, role: str = "client"):
        super().__init__(endpoint, timeout_ms, role)
        self._zmq, self._curve = zmq, curve
        self._ctx = zmq.Context.instance()
        self._sock = self._monitor = None

    def _reset(self) -> None:
        self._unmonitor()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def _unmonitor(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None

    def _roundtrip(self, body: bytes, deadline: float) -> bytes:
        zmq = self._zmq
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            self._monitor = self._curve.client_monitor(self._sock)
            self._curve.client_socket(self._sock, self._secret, self.role)  # the role's CURVE keys
            self._sock.connect(self.address)
        self._sock.send(body)
        if not self._sock.poll(int(_left(deadline) * 1000), zmq.POLLIN):
            if self._curve.handshake_failed(self._monitor):
                self._reset()
                raise self._curve.refused_error(self.address)
            raise TimeoutError("no reply")
        self._unmonitor()  # the handshake succeeded: nothing left to tell apart (class doc)
        return self._sock.recv()


def _refusal_frame(data: bytes) -> ConnectionRefusedError | None:
    """A server over a connection cap answers its refusal frame (request id 0) instead of the handshake: the
    ConnectionRefusedError naming its reason, or None for anything else."""
    try:
        (n,) = protocol.HEADER.unpack_from(data)
        msg = protocol.unpack(data[protocol.HEADER.size : protocol.HEADER.size + n])
    except Exception:  # noqa: BLE001 - not a frame at all: the caller reports the malformed handshake
        return None
    if isinstance(msg, list) and len(msg) == 4 and msg[1] == 0 and msg[2] is False:
        try:
            protocol.parse_response(msg, 0)
        except ProtocolError as e:  # id 0: "connection refused: <reason>"
            return ConnectionRefusedError(str(e))
    return None


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left
