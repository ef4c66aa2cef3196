"""TCP transport (any host): frames per wire.py over pooled connections, several per peer.

A batch is cut into frames (big entries split, small ones packed), the frames are spread over up to
``tcp_connections`` connections running in parallel, writes are sent with sendmsg straight from
registered memory and reads land with recv_into straight in it (no copy through Python bytes).
A pooled connection is checked for a close by the server (its idle timeout) before reuse and replaced
transparently; a server over its connection caps refuses with a reason, raised as TransferFailed.
"""
from __future__ import annotations

import itertools
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvplugins import security
from kvplugins.errors import AuthError, OutOfRange, ProtocolError, TransferError, TransferFailed
from kvplugins.security import handshake
from kvplugins.transfer import wire
from kvplugins.transfer.api import RegionInfo, SegmentDescriptor
from kvplugins.transfer.config import MIN_FRAME, TransferConfig
from kvplugins.transfer.memory import RegionTable, view_of
from kvplugins.transfer.spans import as_list
from kvplugins.transfer.sockio import FrameReader, reusable, send_all
from kvplugins.transfer.tcp_server import TcpServer
from kvplugins.transfer.transport import Deadline, Entry, Op, Transport

MIN_PIECE = 1 << 20  # smallest frame worth another connection: a thread handoff costs ~50-100 us


@dataclass(frozen=True)
class Piece:
    """A contiguous part of entry ``index``: ``length`` bytes at local_addr <-> (region, offset)."""
    index: int
    local_addr: int
    region: int
    offset: int
    length: int


def plan_frames(entries: list[Entry], indexes: list[int], limit: int, conns: int) -> list[list[Piece]]:
    """Cut entries into frames of at most ``limit`` payload bytes and MAX_ENTRIES pieces; a batch big
    enough is cut into at least ``conns`` frames so every connection gets a share."""
    total = sum(entries[i].length for i in indexes)
    target = min(limit, max(MIN_PIECE, -(-total // conns)))
    frames: list[list[Piece]] = [[]]
    room = target
    for i in indexes:
        e, off = entries[i], 0
        while off < e.length:
            if room == 0 or len(frames[-1]) == wire.MAX_ENTRIES:
                frames.append([])
                room = target
            n = min(room, e.length - off)
            frames[-1].append(Piece(i, e.local_addr + off, e.remote_region.region_id, e.remote_offset + off, n))
            off, room = off + n, room - n
    return [f for f in frames if f]


def plan_span_frames(addrs: list[int], offs: list[int], lens: list[int], region: int, limit: int,
                     conns: int) -> list[list[Piece]]:
    """plan_frames for the array form: spans j (to one remote ``region``) cut into frames the same way."""
    total = sum(lens)
    target = min(limit, max(MIN_PIECE, -(-total // conns)))
    if total <= target and len(lens) <= wire.MAX_ENTRIES:       # the common small batch: one frame
        return [[Piece(j, a, region, o, n) for j, (a, o, n) in enumerate(zip(addrs, offs, lens))]]
    frames: list[list[Piece]] = [[]]
    room = target
    for j, (a, o, length) in enumerate(zip(addrs, offs, lens)):
        off = 0
        while off < length:
            if room == 0 or len(frames[-1]) == wire.MAX_ENTRIES:
                frames.append([])
                room = target
            n = min(room, length - off)
            frames[-1].append(Piece(j, a + off, region, o + off, n))
            off, room = off + n, room - n
    return [f for f in frames if f]


class TcpTransport(Transport):
    """Offers {"host", "port", "max_frame"} of its server; reaches every peer offering a valid tcp endpoint."""
    name = "tcp"

    def __init__(self, config: TransferConfig, regions: RegionTable):
        self._cfg = config
        self._secret = security.resolve()     # the cluster's shared secret (None: loopback-only, no handshake)
        self._server = TcpServer(config.host, config.tcp_port, regions, config.max_frame, config.server_limits(),
                                 secret=self._secret)
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._io = ThreadPoolExecutor(config.tcp_connections * config.workers, thread_name_prefix="kvp-tcp-io")
        self._ids = itertools.count(1)

    def endpoint(self) -> dict[str, Any]:
        """{"host", "port"} of this process's server and its max_frame (peers cut frames to fit it)."""
        return {"host": _advertised(self._cfg.host), "port": self._server.port, "max_frame": int(self._cfg.max_frame)}

    def reaches(self, remote: SegmentDescriptor, region: RegionInfo) -> bool:
        ep = remote.transports.get("tcp")
        return isinstance(ep, dict) and isinstance(ep.get("host"), str) and _is_int(ep.get("port")) \
            and 0 < ep["port"] < 65536 and _is_int(ep.get("max_frame", 0))

    def transfer(self, op: Op, entries: list[Entry], deadline: Deadline) -> list[TransferError | None]:
        status: list[TransferError | None] = [None] * len(entries)
        jobs = []
        for peer, indexes in _by_peer(entries).items():
            peer_frame = entries[indexes[0]].remote.transports["tcp"].get("max_frame", self._cfg.max_frame)
            limit = wire.payload_limit(max(MIN_FRAME, min(self._cfg.max_frame, peer_frame)))
            frames = plan_frames(entries, indexes, limit, self._cfg.tcp_connections)
            groups = min(self._cfg.tcp_connections, len(frames))
            jobs += [(peer, frames[g::groups]) for g in range(groups)]
        futures = [self._io.submit(self._run_group, op, p, f, status, deadline) for p, f in jobs[1:]]
        if jobs:
            self._run_group(op, *jobs[0], status, deadline)
        for fut in futures:
            fut.result()
        return status

    def transfer_spans(self, op: Op, batch, deadline: Deadline) -> list[TransferError | None] | None:
        """The array form: frames planned straight from the span arrays (no Entry objects)."""
        ep = batch.remote.transports["tcp"]
        peer = (ep["host"], ep["port"])
        limit = wire.payload_limit(max(MIN_FRAME, min(self._cfg.max_frame, ep.get("max_frame", self._cfg.max_frame))))
        frames = plan_span_frames(as_list(batch.addrs), as_list(batch.roffs), as_list(batch.lens),
                                  batch.info.region_id, limit, self._cfg.tcp_connections)
        status: list[TransferError | None] = [None] * len(batch)
        groups = min(self._cfg.tcp_connections, len(frames))
        jobs = [frames[g::groups] for g in range(groups)]
        futures = [self._io.submit(self._run_group, op, peer, f, status, deadline) for f in jobs[1:]]
        if jobs:
            self._run_group(op, peer, jobs[0], status, deadline)
        for fut in futures:
            fut.result()
        return status

    @property
    def server(self) -> TcpServer:
        """This process's transfer server (another transport registers its control handler on it)."""
        return self._server

    def control(self, ep: dict[str, Any], body: dict, deadline: Deadline) -> dict:
        """Send control request ``body`` (with "kind") to the peer at tcp endpoint ``ep`` over a pooled,
        authenticated connection; returns the peer handler's reply. Raises TransferFailed (peer gone, refused,
        timeout, or the handler's error text)."""
        peer = (ep["host"], ep["port"])
        conn = None
        try:
            conn, _ = self._acquire(peer, deadline, fresh=False)
            req_id = next(self._ids)
            send_all(conn.sock, [wire.encode_control(req_id, body)], deadline.at)
            _, (err, reply) = self._response(conn, deadline, lambda h: wire.decode_control_response(h, req_id))
        except (OSError, ProtocolError, AuthError, TransferFailed) as e:
            if conn is not None:
                conn.sock.close()
            raise _failure(peer, e, deadline) from e
        self._release(peer, conn)
        if err is not None:
            raise TransferFailed(f"tcp peer {peer[0]}:{peer[1]} refused {body.get('kind')!r}: {err}")
        return reply

    def _run_group(self, op: Op, peer: tuple[str, int], frames: list[list[Piece]], status: list,
                   deadline: Deadline) -> None:
        conn, done, fresh = None, 0, False
        try:
            while done < len(frames):
                if conn is None:
                    conn, reused = self._acquire(peer, deadline, fresh)
                try:
                    self._exchange(conn, op, frames[done], status, deadline)
                    done += 1
                except ConnectionError:
                    if not reused:
                        raise
                    conn.sock.close()  # a pooled connection the peer had closed: retry once on a new one
                    conn, fresh = None, True
            self._release(peer, conn)
        except (OSError, ProtocolError, AuthError, TransferFailed) as e:
            if conn is not None:
                conn.sock.close()
            self._drop_idle(peer)
            err = _failure(peer, e, deadline)
            for frame in frames[done:]:
                for p in frame:
                    status[p.index] = status[p.index] or err

    def _exchange(self, conn: "_Conn", op: Op, frame: list[Piece], status: list, deadline: Deadline) -> None:
        if deadline.remaining() <= 0:
            raise TimeoutError("deadline passed")
        sock, reader = conn.sock, conn.reader
        req_id = next(self._ids)
        head = wire.encode_request(op, req_id, [(p.region, p.offset, p.length) for p in frame])
        body = [view_of(p.local_addr, p.length) for p in frame] if op is Op.WRITE else []
        send_all(sock, [head, *body], deadline.at)
        plen, st = self._response(conn, deadline, lambda h: wire.decode_response(h, req_id, len(frame)))
        ok = [p for p, s in zip(frame, st) if s is None] if op is Op.READ else []
        if plen != sum(p.length for p in ok):
            raise ProtocolError(f"response payload {plen} bytes, expected {sum(p.length for p in ok)}")
        reader.read_into(sock, [view_of(p.local_addr, p.length) for p in ok], deadline.at)
        if reader.buffered():
            raise ProtocolError(f"{reader.buffered()} unexpected bytes after a response")
        for p, s in zip(frame, st):
            if s is not None:
                status[p.index] = OutOfRange(f"tcp peer answered: {s}")

    def _response(self, conn: "_Conn", deadline: Deadline, decode):
        """(payload length, ``decode(header)``) of the next response frame on ``conn``. A refusal instead raises
        AuthError (a server with a secret refused us) or TransferFailed (over a connection cap, with its reason)."""
        conn.reader.fill(conn.sock, wire.PREFIX.size, deadline.at)
        prefix = conn.reader.take(wire.PREFIX.size)
        try:
            hlen, plen = wire.parse_prefix(prefix, self._cfg.max_frame)
        except ProtocolError:
            handshake.check_refused(prefix, "the peer")
            raise
        conn.reader.fill(conn.sock, hlen, deadline.at)
        header = conn.reader.take(hlen)
        try:
            return plen, decode(header)
        except ProtocolError:
            _check_refused(header)
            raise

    def _acquire(self, peer: tuple[str, int], deadline: Deadline, fresh: bool) -> tuple["_Conn", bool]:
        """A connection to ``peer`` whose socket timeout is the batch's time left (each call is bounded by it;
        the loops also check the deadline between calls)."""
        left = deadline.remaining()
        if left <= 0:
            raise TimeoutError("deadline passed before connecting")
        conn = None if fresh else self._pooled(peer)
        if conn is not None:
            conn.sock.settimeout(left)
            return conn, True
        sock = socket.create_connection(peer, timeout=left)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._secret is not None:
            handshake.client(sock, self._secret, deadline.at, "the peer")
            sock.settimeout(max(1e-3, deadline.remaining()))
        return _Conn(sock, FrameReader()), False

    def _pooled(self, peer: tuple[str, int]) -> "_Conn | None":
        """An idle pooled connection to ``peer`` still open, or None; those the server closed meanwhile
        (transfer.idle_timeout_ms, a restart) are dropped here instead of failing a frame."""
        while True:
            with self._lock:
                idle = self._idle.get(peer)
                conn = idle.pop() if idle else None
            if conn is None or reusable(conn.sock):
                return conn
            conn.sock.close()

    def _release(self, peer: tuple[str, int], conn: "_Conn | None") -> None:
        if conn is None:
            return
        with self._lock:
            idle = self._idle.setdefault(peer, [])
            if len(idle) < self._cfg.tcp_connections:
                idle.append(conn)
                return
        conn.sock.close()

    def _drop_idle(self, peer: tuple[str, int]) -> None:
        with self._lock:
            conns = self._idle.pop(peer, [])
        for c in conns:
            c.sock.close()

    def close(self) -> None:
        self._server.close()
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for c in conns:
            c.sock.close()
        self._io.shutdown(wait=False)


@dataclass
class _Conn:
    """A pooled connection and its receive buffer."""
    sock: socket.socket
    reader: FrameReader


def _by_peer(entries: list[Entry]) -> dict[tuple[str, int], list[int]]:
    peers: dict[tuple[str, int], list[int]] = {}
    for i, e in enumerate(entries):
        ep = e.remote.transports["tcp"]
        peers.setdefault((ep["host"], ep["port"]), []).append(i)
    return peers


def _check_refused(header) -> None:
    """Raise TransferFailed naming the reason if ``header`` is a refusal (a response to request id 0 with one
    status, tcp_server.py) instead of the response expected; return otherwise."""
    try:
        [reason] = wire.decode_response(header, 0, 1)
    except (ProtocolError, ValueError):
        return
    if reason is not None:
        raise TransferFailed(f"refused the connection: {reason}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _advertised(host: str) -> str:
    """The address peers dial: the bind address, or this host's name for a wildcard bind."""
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


def _failure(peer: tuple[str, int], e: BaseException, deadline: Deadline) -> TransferFailed:
    where = f"tcp peer {peer[0]}:{peer[1]}"
    if isinstance(e, TransferFailed):
        failed = TransferFailed(f"{where} {e}")
        failed.__cause__ = e
        return failed
    if isinstance(e, AuthError):
        failed = TransferFailed(f"{where}: authentication failed: {e}")
        failed.__cause__ = e
        return failed
    if isinstance(e, (TimeoutError, socket.timeout)):
        return TransferFailed(f"{where} did not answer within the {deadline.timeout_ms:g} ms timeout")
    return TransferFailed(f"{where} failed: {type(e).__name__}: {e}")
