"""The node's promote endpoint: the master's raw frame format (protocol.py: 4-byte length + msgpack
``[VERSION, id, op, entries, opts]`` -> ``[VERSION, id, ok, payload]``; never pickle) on a TCP port of the node,
one thread per connection. A client reaches it with client/rpc.py RawRpcClient. Ops: ``promote`` (keys -> per key
``[code, detail]``). Off the per-operation path: only gets of disk-resident objects come here. With a shared
secret configured (kvplugins/security) every connection must pass its handshake first, as on the master's raw
endpoint; binding a non-loopback address without one raises ConfigError.

Hostile input (issue #11):
* every request is decoded straight into typed values (msgspec) before an op sees it: ``promote`` takes a list of
  1..``max_batch`` keys (non-empty strings of at most MAX_KEY characters) and no options. A request that breaks
  it is answered ``ok=false`` with the field's path (``promote: entries: Expected `str`, got `int` - at
  `$[2]```), nothing applied, the connection kept; a body that is not ``[int, int, str, list, map]`` closes it;
* limits (StoreNodeConfig.promote_limits(), kvplugins/security/limits.py): accept() failing with EMFILE & co
  pauses accepting while established connections are served; over ``promote_max_connections`` in all or
  ``promote_max_connections_per_peer`` from one host a connection gets one frame ``[VERSION, 0, False,
  "connection refused: <reason>"]`` (protocol.py: request id 0 is no request's) and is closed; a connection
  with no request for ``promote_idle_timeout_ms`` is closed, and a frame (or the handshake) started must arrive,
  and its reply be taken, within ``promote_frame_timeout_ms``;
* an op that raises fails its request (logged with the op and peer), never the thread or the process.
"""

from __future__ import annotations

import logging
import select
import socket
import socketserver
import threading
import time
from typing import Annotated, Callable

import msgspec
from msgspec import Meta, Struct

from kvplugins import security
from kvplugins.errors import ConfigError, ProtocolError
from kvplugins.security import handshake
from kvplugins.security.limits import ConnLimits, GuardedServerMixIn
from kvplugins.store.wire import protocol
from kvplugins.store.wire.schema import Envelope

log = logging.getLogger(__name__)
MAX_FRAME = 16 << 20  # bytes of one request frame
MAX_KEY = 1 << 16  # characters of one key (schema.MAX_FILE_KEY: the longest a disk tier stores)
RECV_CHUNK = 1 << 20  # bytes per receive: a frame's buffer grows with what arrived, not its claim
DEFAULT_MAX_BATCH = 65536  # keys per promote (StoreNodeConfig.promote_max_batch)


class NoOpts(Struct, forbid_unknown_fields=True):
    """An op without options: any option is an error (a typo is never silently ignored)."""


class OpSchema(Struct, frozen=True):
    """The typed decoders of one op's ``entries`` and ``opts``."""

    entries: msgspec.msgpack.Decoder
    opts: msgspec.msgpack.Decoder


def schemas(max_batch: int) -> dict[str, OpSchema]:
    """Op name -> its decoders, with at most ``max_batch`` entries per request."""
    key = Annotated[str, Meta(min_length=1, max_length=MAX_KEY)]
    return {
        "promote": OpSchema(
            msgspec.msgpack.Decoder(Annotated[list[key], Meta(min_length=1, max_length=max_batch)]),
            msgspec.msgpack.Decoder(NoOpts),
        )
    }


_ENVELOPE = msgspec.msgpack.Decoder(Envelope)


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        sock: socket.socket = self.request
        server, limits = self.server, self.server.limits
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(limits.frame_timeout_s)  # each receive/send must progress within it
        try:
            if server.secret is not None:
                reason = handshake.serve_blocking(sock, server.secret, limits.frame_timeout_s)
                if reason is not None:
                    return server.refusals.refused("disk-tier promote connection", self.client_address, reason)
                sock.settimeout(limits.frame_timeout_s)
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            while self._request_within(poller):
                deadline = time.monotonic() + limits.frame_timeout_s
                body = _recv_frame(sock, deadline)
                if body is None:
                    return
                sock.sendall(protocol.frame(server.answer(body, self.client_address)))  # bounded: timeout
        except TimeoutError:
            server.count_slow(
                self.client_address,
                "a frame (or its reply) did not complete within "
                f"{limits.frame_timeout_s * 1000:g} ms (store.promote_frame_timeout_ms)",
            )
        except (OSError, ProtocolError) as e:
            log.info("promote endpoint: closed connection from %s: %s", self.client_address, e or type(e).__name__)

    def _request_within(self, poller) -> bool:
        """Wait for the next request (or EOF); False after idle_timeout_s without one (0 = wait forever)."""
        idle = self.server.limits.idle_timeout_s
        if poller.poll(max(1, int(idle * 1000)) if idle else None):
            return True
        self.server.count_idle()
        log.debug(
            "promote endpoint: closing connection from %s: no request for %g ms (store.promote_idle_timeout_ms)",
            self.client_address,
            idle * 1000,
        )
        return False


class _Server(GuardedServerMixIn, socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, host: str, ops: dict, limits: ConnLimits, max_batch: int):
        self.secret = security.require("the disk tier's promote endpoint")
        security.require_for_bind(host, self.secret, "store --host (the disk tier's promote endpoint)")
        known = schemas(max_batch)
        missing = sorted(set(ops) - set(known))
        if missing:
            raise ConfigError(
                f"promote endpoint: no schema for op(s) {', '.join(missing)}; known: "
                f"{', '.join(sorted(known))} (add one to kvplugins/store/node/disk/server.py)"
            )
        self.ops, self.schemas, self.max_batch = ops, {op: known[op] for op in ops}, max_batch
        super().__init__((host, 0), _Handler)
        self.guard(
            limits,
            f"the promote endpoint on port {self.server_address[1]}",
            "store.promote_",
            lambda reason: protocol.frame([protocol.VERSION, 0, False, f"connection refused: {reason}"]),
        )

    def answer(self, body: bytes, peer) -> list:
        """The reply to one request frame. Raises ProtocolError (the connection closes) if the body is not a
        request envelope; a bad op, entry or option is answered ok=false naming the field."""
        rid, op, entries, opts = _envelope(body)
        fn, schema = self.ops.get(op), self.schemas.get(op)
        if fn is None or schema is None:
            return [protocol.VERSION, rid, False, f"unknown op {op!r}; valid: {', '.join(sorted(self.ops))}"]
        try:
            typed_entries = schema.entries.decode(entries)
        except (msgspec.DecodeError, UnicodeDecodeError) as e:  # ValidationError included: the message names the path
            return [protocol.VERSION, rid, False, self._explain(op, "entries", e)]
        try:
            typed_opts = schema.opts.decode(opts)
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            return [protocol.VERSION, rid, False, self._explain(op, "opts", e)]
        try:
            return [protocol.VERSION, rid, True, fn(typed_entries, typed_opts)]
        except Exception as e:  # noqa: BLE001 - fail this request, keep serving
            log.exception("promote endpoint: op %s from %s failed", op, peer)
            return [protocol.VERSION, rid, False, f"{op}: {e!r}"]

    def _explain(self, op: str, where: str, err: msgspec.DecodeError) -> str:
        """The refusal text: op, part, msgspec's reason with the field's path, and the limit's config key."""
        text = str(err)
        if f"length <= {self.max_batch}" in text:
            text += f" (at most store.promote_max_batch={self.max_batch} keys per request)"
        elif f"length <= {MAX_KEY}" in text:
            text += f" (keys are at most {MAX_KEY} characters)"
        return f"{op}: invalid {where}: {text}"


class OpServer:
    """Serve ``ops`` (name -> fn(entries, opts) -> payload; each op needs a schema, ``schemas``) on ``host``:0
    in a background thread, under ``limits`` (default ConnLimits()) with at most ``max_batch`` entries per
    request. Raises ConfigError for an op without a schema or a non-loopback host without a secret."""

    def __init__(
        self, host: str, ops: dict[str, Callable], limits: ConnLimits | None = None, max_batch: int = DEFAULT_MAX_BATCH
    ):
        self._server = _Server(host, ops, limits or ConnLimits(), max_batch)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="kvp-disk-endpoint", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def stats(self) -> dict[str, int]:
        """Connections open; refused over a cap; accept() failures survived; closed idle; closed slow."""
        return self._server.guard_stats()

    def close(self) -> None:
        """Stop accepting and end every connection (their threads exit). Idempotent."""
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        self._thread.join(timeout=5)


def _envelope(body: bytes) -> tuple[int, str, msgspec.Raw, msgspec.Raw]:
    """(request id, op, raw entries, raw opts) of a request body. Raises ProtocolError naming what is wrong."""
    try:
        env = _ENVELOPE.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:  # (deep nesting: the last)
        raise ProtocolError(f"request must be [int version, int id, str op, list entries, map opts]: {e}") from None
    if env.version != protocol.VERSION:
        raise ProtocolError(f"request version {env.version!r} unsupported (this endpoint speaks {protocol.VERSION})")
    return env.rid, env.op, env.entries, env.opts


def _recv_frame(sock: socket.socket, deadline: float) -> bytes | None:
    """The next frame's body (at most MAX_FRAME bytes), None if the peer closed between frames. Raises
    ProtocolError (over MAX_FRAME, closed mid-frame), TimeoutError (not complete by ``deadline``, monotonic s)."""
    head = _recv_exact(sock, protocol.HEADER.size, deadline)
    if head is None:
        return None
    (n,) = protocol.HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    if time.monotonic() > deadline:
        raise TimeoutError("frame header arrived after the frame's deadline")
    body = _recv_exact(sock, n, deadline)
    if body is None:
        raise ProtocolError("connection closed inside a frame")
    return body


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        if buf and time.monotonic() > deadline:
            raise TimeoutError(f"frame incomplete ({len(buf)} of {n} bytes) at its deadline")
        chunk = sock.recv(min(n - len(buf), RECV_CHUNK))
        if not chunk:
            if buf:
                raise ProtocolError(f"connection closed after {len(buf)} of {n} bytes")
            return None
        buf += chunk
    return bytes(buf)
