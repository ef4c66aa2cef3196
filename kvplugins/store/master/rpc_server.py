"""Serves MasterService on two endpoints from one single-threaded selector (epoll) loop.

* raw endpoint (``host:port``, the master address): length-prefixed msgpack frames over TCP, used by clients on
  the per-operation path (~20 µs round trip here).
* zmq ROUTER endpoint (reported by the ``info`` op): the control plane — node registration, heartbeats,
  ``kvplugins status`` (~115 µs round trip; fine off the hot path).
Both run the same dispatcher: every request is decoded into typed, range-checked values (kvplugins/store/wire/schema.py)
before the service sees it. A request the schema refuses is answered with the reason (connection kept); a frame
that is no request (wrong version, too large, not msgpack of the envelope's shape) closes that connection with a
logged reason; a bad zmq message is logged and dropped.
The periodic sweep (service.tick) runs every ``tick_ms`` in the same loop, so the logic needs no locks.
The zmq socket joins the selector through its edge-triggered ZMQ_FD: when it fires (and on every tick) the
ROUTER is drained while zmq.EVENTS reports input; plain sockets are level-triggered.

What a client cannot do to the loop (issue #11; limits in MasterConfig, docs/operations.md Security):
* kill it: an exception while serving one request answers that request; one in a connection's handling drops
  that connection; one in a periodic subsystem (tick, sweep, metrics, group commit) is logged (rate-limited)
  and counted in ``internal_errors`` (kvplugins_master_internal_errors_total), and the loop goes on.
* exhaust descriptors: accept() failing with EMFILE/ENFILE/ENOBUFS/ENOMEM pauses accepting (security/limits.py)
  while established connections are served; ``max_connections``/``max_connections_per_peer`` count
  *authenticated* connections only and refuse the rest with a reply frame (request id 0) that names the limit.
* lock others out: a connection that has not authenticated yet sits in a pool of its own (UNAUTH_POOL, each with
  the handshake's deadline); a new one arriving while the pool is full evicts the oldest, so idle or silent
  peers without a credential never keep an authenticated client from connecting (issue #30).
* hold memory: a frame is at most ``max_frame``; partly received frames of all connections share
  ``partial_frames_budget`` (past it the connection holding the most is dropped); a connection whose unsent
  replies exceed ``reply_buffer`` is not read until they drain, and one that reads none for ``frame_timeout_ms``
  is dropped; a batch is at most ``max_batch`` entries.
* hold the thread: idle connections close after ``idle_timeout_ms``, a frame started must arrive within
  ``frame_timeout_ms``; remove_by_regex/remove_all run as slices (admin_ops.Scan) between other events, at most
  MAX_SCANS at once, on RE2; a data batch of more than batches.SLICE_KEYS entries runs in slices too (at most
  MAX_SLICED at once), and all deferred ops together take at most TURN_BUDGET_S of a loop turn, round robin,
  so a 65,536-key put_start keeps no other client waiting.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import selectors
import socket
import time

import msgspec
import zmq

from kvplugins import security
from kvplugins.errors import ProtocolError
from kvplugins.security.curve import CurveServer, caller_of
from kvplugins.security.limits import AcceptBackoff, ConnGate
from kvplugins.security.roles import FORBIDDEN, refusal
from kvplugins.security.secret import proved_identity
from kvplugins.store.config import MasterConfig
from kvplugins.store.master.admin_ops import Scan
from kvplugins.store.master.admission import Prober
from kvplugins.store.master.batches import Deferred
from kvplugins.store.master.events import EventPublisher
from kvplugins.store.master.ha import group_commit
from kvplugins.store.master.metadata import FRONT_EXISTS, FRONT_GET, FRONT_PUT
from kvplugins.store.master.service import MasterService
from kvplugins.store.metrics import MasterMetrics
from kvplugins.store.wire import protocol
from kvplugins.store.wire.schema import RefusedRequest, Schemas

log = logging.getLogger(__name__)
RECV_CHUNK = 1 << 16  # below malloc's mmap threshold: a 1 MiB recv buffer costs ~20 µs per call
# The object table holds millions of small objects; with CPython's default gen-0 threshold (700) the collector
# walks them so often that put_start costs 2x (12 vs 5-6 µs per key measured). The master's objects form no
# cycles on the hot path, so collections may be rare. Applied by serve_forever (the master's process).
GC_THRESHOLDS = (50_000, 20, 20)
ACCEPTS_PER_TURN = 64  # connections accepted per readiness event (the rest wait for the next turn)
MAX_SCANS = 4  # admin scans running at once; more are refused (retry later)
MAX_SLICED = 1024  # sliced data batches running at once (one per raw connection); more are refused
PROBE_POLL_S = 0.002  # how often the loop looks at running admission probes when nothing else is due
TURN_BUDGET_S = 0.02  # time all deferred ops may take in one loop turn (each step: batches.SLICE_BUDGET_S)
UNAUTH_POOL = 256  # connections still in their handshake; a new one past it evicts the oldest
ZMQ_MAX_MSG = 16 << 20  # control-plane messages are small (a tier_register chunk ~1.5 MB); zmq drops larger
ZMQ_RCVHWM = 64  # messages queued per control-plane peer: with ZMQ_MAX_MSG, at most 1 GiB per peer
ERROR_LOG_INTERVAL_S = 10.0  # an internal error of one subsystem is logged at most this often


class _Conn:
    def __init__(self, sock: socket.socket, peer, now: float):
        self.sock, self.peer = sock, peer
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.events = selectors.EVENT_READ
        self.guard = None  # security.ServerHandshake until the peer has authenticated
        self.role = ""  # the role it authenticated as (security/roles.py): fixed for the connection
        self.identity = ""  # its named credential, role:name ("" for a secret holder): master/quotas.py
        self.last_request = now  # when its last request was served (idle timeout)
        self.frame_since = 0.0  # when the partial frame in inbuf began (slowloris)
        self.progress = now  # when its unsent replies last moved (a peer that does not read)
        self.scan = False  # an admin scan of this connection runs: its later frames wait
        self.front = 0  # the metadata.FRONT_* ops its role may run natively (service.serve_native), once authenticated


class RpcServer:
    """Bind both endpoints (port 0 = any) and serve ``service`` until ``stop()``."""

    def __init__(self, config: MasterConfig, service: MasterService | None = None):
        self.cfg = config
        self._secret = security.resolve_server("the master")  # both endpoints authenticate every peer's role
        security.require_for_bind(config.host, self._secret, "master --host")
        self._refusals = security.RefusalLog()
        self._listener = socket.create_server((config.host, config.port), reuse_port=False, backlog=1024)
        self._listener.setblocking(False)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, min(int(config.max_frame), ZMQ_MAX_MSG))
        self._router.setsockopt(zmq.RCVHWM, ZMQ_RCVHWM)
        self._curve = CurveServer(self._router, self._secret)
        if config.zmq_port:
            self._router.bind(f"tcp://{config.host}:{config.zmq_port}")
        else:
            self._router.bind_to_random_port(f"tcp://{config.host}")
        self.zmq_endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.service = service or MasterService(config, zmq_endpoint=self.zmq_endpoint)
        self.service.zmq_endpoint = self.zmq_endpoint
        self._prober = Prober(config.admission_probe_ms, config.host) if config.admission_probe_ms > 0 else None
        self.service.prober = self._prober  # segments registered over RPC are probed before placement
        self._schemas = Schemas.of(config)
        self._encode = msgspec.msgpack.Encoder().encode
        self._limits = config.conn_limits()
        self._gate = ConnGate(self._limits, "the master's RPC endpoint", "master.")
        self._backoff = AcceptBackoff("master RPC endpoint")
        self._accept_resume = 0.0  # while > 0 the listener is out of the selector until then (monotonic s)
        self._partial = 0  # bytes in every connection's inbuf
        self._scans: list[tuple] = []  # (owner: _Conn or zmq envelope, rid, op, Scan)
        self.internal_errors: dict[str, int] = {}
        self._error_logged: dict[str, float] = {}
        self.metrics = MasterMetrics(self, config)  # op latency timer; /metrics if metrics_port >= 0
        self._group = group_commit.for_server(self)  # HA master: replies wait for their etcd writes
        self._grouped = isinstance(self._group, group_commit.GroupCommit)
        self._one_max = protocol.HEADER.size + min(int(config.max_frame), RECV_CHUNK)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._router.getsockopt(zmq.FD), selectors.EVENT_READ, "zmq")
        self._events = self._start_events(config)
        self._conns: dict[int, _Conn] = {}
        self._unauth: dict[int, _Conn] = {}  # connections in their handshake, oldest first (not in _gate)
        self._stopped = False

    def _start_events(self, config: MasterConfig):
        """The KV event publisher (master/events.py) when events_port >= 0, installed in the service; else None."""
        if config.events_port < 0:
            return None
        ep = EventPublisher(
            self._ctx,
            self._secret,
            _zmq_bind(config.host, config.events_port),
            _zmq_bind(config.host, config.events_replay_port),
            config.events_topic,
            config.events_buffer,
        )
        self.service.events = ep
        self.service.events_endpoints = ep.endpoints
        self._sel.register(ep.replay.getsockopt(zmq.FD), selectors.EVENT_READ, "events")
        log.info("KV events on %s (replay %s)", *ep.endpoints)
        return ep

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
                wait = max(0.0, next_tick - time.monotonic())
                if self._scans:  # deferred ops with work to do: none; ones waiting on a probe: briefly
                    wait = min(wait, PROBE_POLL_S) if all(s[3].waiting for s in self._scans) else 0.0
                for key, ev in self._sel.select(wait):
                    self._on_event(key, ev)
                if self._scans:
                    self._guarded("scan", self._step_scans)
                if time.monotonic() >= next_tick:
                    self._guarded("zmq", self._on_zmq)  # safety net for the edge-triggered ZMQ_FD
                    if self._events is not None:
                        self._guarded("events", self._events.serve_replay)
                    self._guarded("tick", self.service.tick)
                    self._guarded("sweep", self._sweep)
                    self._guarded("metrics", self.metrics.publish)  # snapshot for the metrics thread
                    next_tick = time.monotonic() + tick_s
                if self._grouped:
                    self._guarded("group_commit", self._group.sync)  # HA: persist this turn, then send its replies
                if self._events is not None:
                    self._guarded("events", self._events.flush)  # this turn's KV events: one batch
        finally:
            self.close()

    def close(self) -> None:
        if self._prober is not None:
            self._prober.close()
        self.metrics.close()
        for conn in list(self._conns.values()):
            self._drop(conn, None)
        self._sel.close()
        self._listener.close()
        self._router.close(0)
        self._curve.close()
        self.service.events.close()
        self._ctx.term()

    def guard_stats(self) -> dict:
        """Connections open and refused, accept() failures survived, internal errors per subsystem (metrics)."""
        return {
            "connections": self._gate.total,
            "refused": self._gate.refused,
            "accept_failures": self._backoff.failures,
            "internal_errors": dict(self.internal_errors),
        }

    def _guarded(self, subsystem: str, fn, *args) -> None:
        """Run one periodic subsystem; an exception is counted and logged (rate-limited), never fatal."""
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - crash containment: the loop serves every other client on
            self.internal_errors[subsystem] = self.internal_errors.get(subsystem, 0) + 1
            now = time.monotonic()
            if now - self._error_logged.get(subsystem, -1e18) >= ERROR_LOG_INTERVAL_S:
                self._error_logged[subsystem] = now
                log.exception(
                    "master %s failed (%d times so far); the master goes on", subsystem, self.internal_errors[subsystem]
                )

    # ---- dispatch ------------------------------------------------------------------------------------
    def _answer(self, body: bytes, role: str, identity: str):
        """Reply body for one request body from a peer authenticated as ``role`` (and ``identity``: its named
        credential, "" for a secret holder), or (rid, op, Scan) for an admin scan to run in slices. An op outside
        the role is refused (roles.FORBIDDEN). Raises ProtocolError for a frame that is not a request."""
        try:
            rid, op, entries, opts = self._schemas.decode(body, role)
        except RefusedRequest as e:
            return self._reply(e.rid, False, str(e), "?")
        if op == "register_segment" and identity.endswith(":*") and opts.proof:  # a credential on zmq
            identity = proved_identity(self._secret, role, opts.name, opts.owner, opts.proof)
            if identity is None:
                return self._reply(
                    rid,
                    False,
                    f"{FORBIDDEN}register_segment: the proof of credential "
                    f"{role}:{opts.name} does not match (a different secret?)",
                    op,
                )
        t0 = time.perf_counter()
        try:
            payload, ok = self.service.handle(op, entries, opts, defer=True, caller=identity), True
        except (ValueError, TypeError, KeyError) as e:
            payload, ok = f"{op}: {e}", False
        except Exception as e:  # noqa: BLE001 - a logic bug answers this request; the master keeps serving
            log.exception("op %s failed", op)
            self.internal_errors["op"] = self.internal_errors.get("op", 0) + 1
            payload, ok = f"{op}: internal error {e!r:.200}", False
        if isinstance(payload, Deferred):
            return rid, op, payload
        if ok:
            self.metrics.timer.record(op, time.perf_counter() - t0)
        return self._reply(rid, ok, payload, op)

    def _reply(self, rid: int, ok: bool, payload, op: str) -> bytes:
        try:
            return self._encode((protocol.VERSION, rid, ok, payload))
        except Exception as e:  # noqa: BLE001 - a reply that cannot be encoded fails its request, not the master
            log.exception("reply to %s could not be encoded", op)
            self.internal_errors["encode"] = self.internal_errors.get("encode", 0) + 1
            return self._encode(
                (protocol.VERSION, rid, False, f"{op}: internal error: reply not encodable: {e!r:.200}")
            )

    def _start_scan(self, owner, answer) -> bytes | None:
        """Queue a deferred op for ``owner``; returns a refusal reply instead when MAX_SCANS admin scans (or
        MAX_SLICED sliced batches) already run."""
        rid, op, scan = answer
        kind, cap = ("admin scans", MAX_SCANS) if type(scan) is Scan else ("sliced batches", MAX_SLICED)
        if sum(type(s[3]) is type(scan) for s in self._scans) >= cap:
            return self._reply(rid, False, f"{op}: {cap} {kind} are running; retry later", op)
        self._scans.append((owner, rid, op, scan))
        return None

    def _step_scans(self) -> None:
        """Step the deferred ops round robin until TURN_BUDGET_S has passed: one stepped and not done goes to the
        back, so the ones not reached this turn go first next turn."""
        until = time.perf_counter() + TURN_BUDGET_S
        for n, item in enumerate(list(self._scans)):
            if n and time.perf_counter() > until:
                return
            owner, rid, op, scan = item
            try:
                done, ok, payload = self.service.step(scan), True, scan.result
            except ValueError as e:  # an HA master lost its lead mid-scan
                done, ok, payload = True, False, f"{op}: {e}"
            except Exception as e:  # noqa: BLE001 - a logic bug fails this op; the master keeps serving
                log.exception("deferred op %s failed", op)
                self.internal_errors["op"] = self.internal_errors.get("op", 0) + 1
                done, ok, payload = True, False, f"{op}: internal error {e!r:.200}"
            self._scans.remove(item)
            if not done:
                self._scans.append(item)
                continue
            reply = self._reply(rid, ok, payload, op)
            if isinstance(owner, _Conn):
                if self._conns.get(owner.sock.fileno()) is owner:
                    owner.scan = False
                    self._queue_reply(owner, reply)
                    self._serve_conn(owner)
            else:
                self._group.send_zmq(owner + [reply])

    def _on_event(self, key, ev: int) -> None:
        conn = key.data
        if conn == "zmq":
            return self._guarded("zmq", self._on_zmq)
        if conn == "events":
            return self._guarded("events", self._events.serve_replay)
        if conn is None:
            return self._guarded("accept", self._accept)
        if self._conns.get(conn.sock.fileno()) is not conn:
            return
        try:
            if ev & selectors.EVENT_READ:
                self._on_readable(conn)
            if (
                ev & selectors.EVENT_WRITE
                and self._conns.get(conn.sock.fileno()) is conn
                and not self._group.holds(conn)
            ):
                self._flush(conn)
                if conn.inbuf and not conn.scan and len(conn.outbuf) <= self.cfg.reply_buffer:
                    self._serve_conn(conn)  # frames held back while its replies were unread
        except Exception as e:  # noqa: BLE001 - crash containment: only this connection goes
            self.internal_errors["connection"] = self.internal_errors.get("connection", 0) + 1
            log.exception("serving %s failed; its connection is closed", conn.peer)
            self._drop(conn, f"internal error {e!r:.200}")

    def _on_zmq(self) -> None:
        """Drain the ROUTER; reading zmq.EVENTS each turn also re-arms its edge-triggered FD."""
        while self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            parts = [f.bytes for f in frames]
            try:
                reply = self._answer(parts[-1], *caller_of(frames[-1]))
            except ProtocolError as e:
                log.warning("dropped zmq message from %r: %s", parts[0], e)
                continue
            if type(reply) is tuple:
                reply = self._start_scan(parts[:-1], reply)
            if reply is not None:
                self._group.send_zmq(parts[:-1] + [reply])

    # ---- raw endpoint --------------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if not AcceptBackoff.retryable(e):
                    log.warning("master RPC endpoint: accept failed: %s", e)  # e.g. ECONNABORTED: next one
                    continue
                self._pause_accept(self._backoff.failed(e))
                return
            self._backoff.ok()
            if len(self._unauth) >= UNAUTH_POOL:
                oldest = next(iter(self._unauth.values()))
                self._refusals.refused(
                    "master RPC connection",
                    oldest.peer,
                    f"evicted: {UNAUTH_POOL} connections were still authenticating",
                )
                self._drop(oldest, None)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, peer, time.monotonic())
            conn.guard = security.ServerHandshake(self._secret)
            self._conns[sock.fileno()] = self._unauth[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _pause_accept(self, seconds: float) -> None:
        """Stop accepting for ``seconds`` (the sweep resumes it): the backlog keeps the listener readable."""
        if not self._accept_resume:
            self._sel.unregister(self._listener)
        self._accept_resume = time.monotonic() + seconds

    def _refuse(self, sock: socket.socket, peer, reason: str) -> None:
        """Tell an over-limit peer why (a reply to request id 0, which no client uses), then close."""
        self._refusals.refused("master RPC connection", peer, reason)
        try:
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.recv(RECV_CHUNK)  # a request already sent would make close() reset, losing the reason
            sock.send(protocol.frame([protocol.VERSION, 0, False, f"connection refused: {reason}"]))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        sock.close()

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            return self._drop(conn, f"recv failed: {e}")
        if not data:
            return self._drop(conn, None)
        if not (conn.inbuf or conn.outbuf or conn.scan or self._grouped) and conn.guard is None:
            if self._one_frame(conn, data):
                return
        if not conn.inbuf:
            conn.frame_since = time.monotonic()
        conn.inbuf += data
        self._partial += len(data)
        if conn.guard is not None:
            before = len(conn.inbuf)
            passed = self._authenticate(conn)
            self._partial -= before - len(conn.inbuf)
            if not passed:
                return
        if not conn.scan and len(conn.outbuf) <= self.cfg.reply_buffer:
            self._serve_conn(conn)
        if self._partial > self.cfg.partial_frames_budget:
            self._shed()

    def _one_frame(self, conn: _Conn, data: bytes) -> bool:
        """The common case without the buffers: ``data`` is exactly one whole request frame on an idle, authenticated
        connection of a plain master (an HA master's replies wait for group commit). Served as _serve_frames serves
        a frame, its reply sent at once; what the socket does not take waits in ``outbuf`` as a queued reply would.
        False, nothing done, for anything else."""
        hdr = protocol.HEADER.size
        if len(data) <= hdr or protocol.HEADER.unpack_from(data)[0] != len(data) - hdr or len(data) > self._one_max:
            return False
        try:
            reply = self._reply_to(conn, data[hdr:], time.monotonic())
        except ProtocolError as e:
            self._drop(conn, str(e))
            return True
        if reply is None:
            return True
        out = protocol.HEADER.pack(len(reply)) + reply
        try:
            sent = conn.sock.send(out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            self._drop(conn, f"send failed: {e}")
            return True
        if sent < len(out):
            conn.progress = time.monotonic()
            conn.outbuf += out[sent:]
            self._flush(conn)  # registers EVENT_WRITE for the rest
        return True

    def _reply_to(self, conn: _Conn, body: bytes, now: float) -> bytes | None:
        """The reply to request ``body`` on ``conn``, or None while it runs as a deferred op (its reply is queued
        when done). Raises ProtocolError for a frame that is no request."""
        conn.last_request = now
        if conn.front:
            t0 = time.perf_counter()
            served = self.service.serve_native(body, conn.front)
            if served is not None:
                self.metrics.timer.record(served[1], time.perf_counter() - t0)
                return served[0]
        reply = self._answer(body, conn.role, conn.identity)
        if type(reply) is tuple:
            reply = self._start_scan(conn, reply)
            conn.scan = reply is None
        return reply

    def _serve_conn(self, conn: _Conn) -> None:
        """Serve the complete frames in ``conn.inbuf`` and queue (or flush) their replies."""
        before = len(conn.inbuf)
        try:
            self._serve_frames(conn)
        except ProtocolError as e:
            return self._drop(conn, str(e))
        finally:
            self._partial -= before - len(conn.inbuf)
        if conn.inbuf and len(conn.inbuf) != before:
            conn.frame_since = time.monotonic()  # the rest is the start of the next frame
        self._group.hold(conn)

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
            del self._unauth[conn.sock.fileno()]
            refusal = self._gate.admit(conn.peer, conn.guard.identity)  # budgets: authenticated connections
            if refusal is not None:
                self._flush(conn)
                self._conns.pop(conn.sock.fileno(), None)
                self._sel.unregister(conn.sock)
                self._partial -= len(conn.inbuf)
                self._refuse(conn.sock, conn.peer, refusal)
                return False
            conn.role, conn.identity, conn.guard = conn.guard.role, conn.guard.identity, None
            conn.front = _front_ops(conn.role)
        return outcome is True

    def _serve_frames(self, conn: _Conn) -> None:
        hdr, now = protocol.HEADER.size, time.monotonic()
        while len(conn.inbuf) >= hdr and not conn.scan and len(conn.outbuf) <= self.cfg.reply_buffer:
            (n,) = protocol.HEADER.unpack_from(conn.inbuf)
            if n > self.cfg.max_frame:
                raise ProtocolError(f"frame of {n} bytes exceeds max_frame {self.cfg.max_frame}")
            if len(conn.inbuf) < hdr + n:
                return
            body = bytes(conn.inbuf[hdr : hdr + n])
            del conn.inbuf[: hdr + n]
            reply = self._reply_to(conn, body, now)
            if reply is not None:
                self._queue_reply(conn, reply)

    def _queue_reply(self, conn: _Conn, reply: bytes) -> None:
        if not conn.outbuf:
            conn.progress = time.monotonic()
        conn.outbuf += protocol.HEADER.pack(len(reply)) + reply

    def _flush(self, conn: _Conn) -> None:
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
                conn.progress = time.monotonic()
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                return self._drop(conn, f"send failed: {e}")
        # read while its replies drain (unread replies past reply_buffer pause it); write while bytes wait
        events = (selectors.EVENT_READ if len(conn.outbuf) <= self.cfg.reply_buffer else 0) | (
            selectors.EVENT_WRITE if conn.outbuf else 0
        )
        if events != conn.events:
            conn.events = events
            self._sel.modify(conn.sock, events, conn)

    # ---- limits --------------------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Once per tick: resume accepting, close idle, slow, unauthenticated and non-reading connections."""
        now = time.monotonic()
        if self._accept_resume and now >= self._accept_resume:
            self._accept_resume = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        lim = self._limits
        for conn in list(self._conns.values()):
            why = None
            if conn.guard is not None and conn.guard.overdue(now):
                self._refusals.refused("master RPC connection", conn.peer, conn.guard.reason)
                why = ""
            elif conn.outbuf and now - conn.progress > lim.frame_timeout_s:
                why = f"it read none of its {len(conn.outbuf)} reply bytes in {lim.frame_timeout_s:g} s"
            elif (
                conn.inbuf
                and not conn.scan
                and conn.events & selectors.EVENT_READ
                and now - conn.frame_since > lim.frame_timeout_s
                and not self._complete_frame(conn.inbuf)
            ):
                why = (
                    f"a frame started {now - conn.frame_since:.1f} s ago is still incomplete "
                    f"(master.frame_timeout_ms={self.cfg.frame_timeout_ms})"
                )
            elif (
                lim.idle_timeout_s
                and not conn.inbuf
                and not conn.outbuf
                and not conn.scan
                and now - conn.last_request > lim.idle_timeout_s
            ):
                log.debug("closing idle connection from %s", conn.peer)
                why = ""
            if why is not None:
                self._drop(conn, why or None)

    @staticmethod
    def _complete_frame(buf: bytearray) -> bool:
        return (
            len(buf) >= protocol.HEADER.size and len(buf) >= protocol.HEADER.size + protocol.HEADER.unpack_from(buf)[0]
        )

    def _shed(self) -> None:
        """Partly received frames exceed the budget: drop the connection holding the most."""
        conn = max(self._conns.values(), key=lambda c: len(c.inbuf))
        self._drop(
            conn,
            f"partly received frames of all connections hold {self._partial} bytes, over "
            f"master.partial_frames_budget={self.cfg.partial_frames_budget}; this one held "
            f"{len(conn.inbuf)}",
        )

    def release(self, conn: _Conn, failed: str | None = None) -> None:
        """Send ``conn``'s held replies, or (``failed``: why) close it without them; nothing if it closed
        meanwhile. On the loop thread: the reply policy (ha/group_commit.py) calls it once per turn."""
        if self._conns.get(conn.sock.fileno()) is conn:
            self._flush(conn) if failed is None else self._drop(conn, failed)

    def send_control(self, parts: list[bytes]) -> None:
        """Send one control-plane reply (the zmq ROUTER's multipart message). On the loop thread."""
        self._router.send_multipart(parts)

    def _drop(self, conn: _Conn, reason: str | None) -> None:
        if reason:
            log.warning("closed connection from %s: %s", conn.peer, reason)
        if self._conns.pop(conn.sock.fileno(), None) is conn:
            if self._unauth.pop(conn.sock.fileno(), None) is None:
                self._gate.release(conn.peer, conn.identity)
            self._partial -= len(conn.inbuf)  # (callers account for what they consumed themselves)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()


def _front_ops(role: str) -> int:
    """The metadata.FRONT_* bits of the ops ``role`` may run (the others' requests go the Python way, refused)."""
    ops = {"get": FRONT_GET, "exists": FRONT_EXISTS, "put": FRONT_PUT}
    return sum(bit for op, bit in ops.items() if refusal(op, role) is None)


def _zmq_bind(host: str, port: int) -> str:
    """A zmq bind address for ``host``:``port`` (port 0: any free port)."""
    return f"tcp://{host}:{port}" if port else f"tcp://{host}:*"
