"""TCP transport (any host): frames per wire.py over pooled connections, several per peer.

Python keeps the set-up: connecting, the shared-secret handshake, the connection pool and control requests.
The data path is native (kvplugins._tcp, native/src/tcp/client.cpp, GIL released): a batch is cut into
frames (big spans split, small ones packed), the frames are spread over up to ``tcp_connections``
connections driven by one poll loop, writes are sent with sendmsg straight from registered memory and reads
land with readv straight in it. A pooled connection is checked for a close by the server (its idle timeout)
before reuse, and one the server had closed anyway is replaced transparently (its spans retried once on a new
connection); a server over its connection caps refuses with a reason, raised as TransferFailed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvplugins import native, security
from kvplugins.errors import AuthError, OutOfRange, ProtocolError, TransferError, TransferFailed
from kvplugins.security import handshake
from kvplugins.transfer import native_tcp, wire
from kvplugins.transfer.api import Region, RegionInfo, SegmentDescriptor
from kvplugins.transfer.config import MIN_FRAME, TransferConfig
from kvplugins.transfer.memory import RegionTable
from kvplugins.transfer.sockio import recv_exact, reusable, send_all
from kvplugins.transfer.tcp_fast import FastRoutes
from kvplugins.transfer.tcp_server import TcpServer
from kvplugins.transfer.transport import Deadline, Entry, Op, Transport

MIN_PIECE = 1 << 20  # smallest frame worth another connection (native/src/tcp/client.cpp cuts frames the same way)


class TcpTransport(Transport):
    """Offers {"host", "port", "max_frame"} of its server; reaches every peer offering a valid tcp endpoint."""

    name = "tcp"

    def __init__(self, config: TransferConfig, regions: RegionTable):
        self._cfg = config
        self._secret = security.require("the TCP transfer server")  # every peer authenticates (role data)
        self._server = TcpServer(
            config.host, config.tcp_port, regions, config.max_frame, config.server_limits(), secret=self._secret
        )
        self.peers = native.tcp_peers(config.tcp_connections, config.max_frame)  # idle connections, routes
        self.fast = FastRoutes(self.peers, config.timeout_ms)  # small batches in one native call (tcp_fast.py)
        self._native = native_tcp.Client()
        self._peers_io = ThreadPoolExecutor(config.workers, thread_name_prefix="kvp-tcp-peer")
        self._ids = itertools.count(1)

    def endpoint(self) -> dict[str, Any]:
        """{"host", "port"} of this process's server and its max_frame (peers cut frames to fit it)."""
        return {"host": _advertised(self._cfg.host), "port": self._server.port, "max_frame": int(self._cfg.max_frame)}

    def reaches(self, remote: SegmentDescriptor, region: RegionInfo) -> bool:
        ep = remote.transports.get("tcp")
        return (
            isinstance(ep, dict)
            and isinstance(ep.get("host"), str)
            and _is_int(ep.get("port"))
            and 0 < ep["port"] < 65536
            and _is_int(ep.get("max_frame", 0))
        )

    def transfer(self, op: Op, entries: list[Entry], deadline: Deadline) -> list[TransferError | None]:
        status: list[TransferError | None] = [None] * len(entries)
        groups: dict[tuple[str, int], list[int]] = {}
        for i, e in enumerate(entries):
            ep = e.remote.transports["tcp"]
            groups.setdefault((ep["host"], ep["port"]), []).append(i)

        def run(indexes: list[int]) -> None:
            ep = entries[indexes[0]].remote.transports["tcp"]
            cols = [
                [entries[i].local_addr for i in indexes],
                [entries[i].remote_region.region_id for i in indexes],
                [entries[i].remote_offset for i in indexes],
                [entries[i].length for i in indexes],
            ]
            got = self._batch(op, ep, *cols, deadline)
            if got is not None:
                for i, s in zip(indexes, got):
                    status[i] = s

        jobs = list(groups.values())
        futures = [self._peers_io.submit(run, ix) for ix in jobs[1:]]
        if jobs:
            run(jobs[0])
        for fut in futures:
            fut.result()
        return status

    def transfer_spans(self, op: Op, batch, deadline: Deadline) -> list[TransferError | None] | None:
        """The array form: one native call with the span arrays (no Entry objects, no per-span Python)."""
        regions = np.full(len(batch), batch.info.region_id, dtype=np.uint64)
        return self._batch(op, batch.remote.transports["tcp"], batch.addrs, regions, batch.roffs, batch.lens, deadline)

    def add_region(self, region: Region) -> None:
        if region.device is None:  # device memory is never a local span (the server stages it for peers)
            self.fast.add_local(region)

    def remove_region(self, region: Region) -> None:
        self.fast.drop_local(region.region_id)  # waits for its fast batches in flight

    def first_choice(self, remote: SegmentDescriptor, info: RegionInfo) -> None:
        """The next small batch to region ``info`` of ``remote`` runs in one native call (tcp_fast.py)."""
        ep = remote.transports["tcp"]
        self.fast.put(remote, info, _peer_key((ep["host"], ep["port"])), self._limit(ep))

    def fast_failed(self, seg: str) -> None:
        """A native fast batch to peer ``seg`` failed (its connection was reset): forget the peer's routes; the
        caller runs the batch its general way."""
        self.fast.drop(seg)

    def stats(self) -> dict[str, Any]:
        """The server's counters (TcpServer.stats: connections open now, refused, accept failures, closed idle,
        closed slow), each prefixed "server_"; "native_entries"/"native_bytes": objects (and their bytes) a store
        client's one-call get read over the pooled connections (native.get_many); "native": the small batches done
        from the engine's entry (tcp_fast.py counts; the router adds them to this transport's)."""
        entries, nbytes = self.peers.counts()
        out = {f"server_{k}": v for k, v in self._server.stats().items()}
        return {**out, "native_entries": entries, "native_bytes": nbytes, "native": self.fast.counts()}

    def route(self, name: str, remote: SegmentDescriptor, region: RegionInfo) -> None:
        """Let a store client's native get (native.get_many) read region ``region`` of ``remote`` (the segment the
        master calls ``name``) over this transport's pooled connections, cut to the frame limit _batch uses."""
        ep = remote.transports["tcp"]
        self.peers.route(name, region.region_id, region.length, _peer_key((ep["host"], ep["port"])), self._limit(ep))

    def _limit(self, ep: dict) -> int:
        """Payload bytes per frame to the peer at tcp endpoint ``ep`` (its max_frame and ours, less the header)."""
        return wire.payload_limit(max(MIN_FRAME, min(self._cfg.max_frame, ep.get("max_frame", self._cfg.max_frame))))

    @property
    def server(self) -> TcpServer:
        """This process's transfer server (another transport registers its control handler on it)."""
        return self._server

    def _batch(self, op: Op, ep: dict, addrs, regions, offs, lens, deadline: Deadline) -> list | None:
        """Spans to one peer; None when all succeeded, else one status per span. Spans of a pooled connection
        the server had closed are retried once on fresh connections."""
        peer = (ep["host"], ep["port"])
        limit = self._limit(ep)
        cols = [np.ascontiguousarray(a, dtype=np.uint64) for a in (addrs, regions, offs, lens)]
        status, retry = self._attempt(op, peer, cols, limit, deadline, fresh=False)
        if retry:
            idx = np.array(retry, dtype=np.int64)
            again, _ = self._attempt(op, peer, [c[idx] for c in cols], limit, deadline, fresh=True)
            for k, j in enumerate(retry):
                status[j] = None if again is None else again[k]
            if not any(s is not None for s in status):
                return None
        return status

    def _attempt(
        self, op: Op, peer: tuple[str, int], cols: list, limit: int, deadline: Deadline, fresh: bool
    ) -> tuple[list | None, list[int]]:
        """One native call over ``want`` connections: (statuses or None, spans worth a retry on fresh ones)."""
        n = len(cols[3])
        conns: list[tuple[socket.socket, bool]] = []
        try:
            for _ in range(_connections(int(cols[3].sum()), n, limit, self._cfg.tcp_connections)):
                conns.append(self._acquire(peer, deadline, fresh))
        except (OSError, AuthError, TransferFailed) as e:
            for sock, _ in conns:
                self._release(peer, sock)
            return [_failure(peer, e, deadline)] * n, []
        codes, bad, broken = self._native.transfer(
            int(op),
            [s.fileno() for s, _ in conns],
            [r for _, r in conns],
            *cols,
            limit,
            self._cfg.max_frame,
            max(0.0, deadline.remaining()),
            deadline.land_by_ms if op is Op.WRITE else 0,
        )
        for (sock, _), b in zip(conns, broken):
            if b:
                _abort(sock)
            else:
                self._release(peer, sock)
        if not bad:
            return None, []
        if any(broken):
            self._drop_idle(peer)
        status: list = [None] * n
        retry = []
        for j, text in bad:
            if codes[j] == native_tcp.SERVER and text.startswith(wire.LATE_WRITE):
                status[j] = TransferFailed(f"tcp peer {peer[0]}:{peer[1]} refused a {text}")
            elif codes[j] == native_tcp.SERVER:
                status[j] = OutOfRange(text)
            elif codes[j] == native_tcp.RETRY and not fresh:
                retry.append(j)
            elif codes[j] == native_tcp.TIMEOUT:
                status[j] = _failure(peer, TimeoutError(), deadline)
            elif codes[j] == native_tcp.AUTH:
                status[j] = _auth_refused(peer, text, deadline)
            else:
                status[j] = TransferFailed(f"tcp peer {peer[0]}:{peer[1]} {text}")
        return status, retry

    def control(self, ep: dict[str, Any], body: dict, deadline: Deadline) -> dict:
        """Send control request ``body`` (with "kind") to the peer at tcp endpoint ``ep`` over a pooled,
        authenticated connection; returns the peer handler's reply. Raises TransferFailed (peer gone, refused,
        timeout, or the handler's error text)."""
        peer = (ep["host"], ep["port"])
        sock = None
        try:
            sock, _ = self._acquire(peer, deadline, fresh=False)
            if not reusable(sock):
                sock.close()
                sock, _ = self._acquire(peer, deadline, fresh=True)
            sock.settimeout(max(1e-3, deadline.remaining()))
            req_id = next(self._ids)
            send_all(sock, [wire.encode_control(req_id, body)], deadline.at)
            err, reply = self._control_response(sock, req_id, deadline)
        except (OSError, ProtocolError, AuthError, TransferFailed) as e:
            if sock is not None:
                sock.close()
            raise _failure(peer, e, deadline) from e
        self._release(peer, sock)
        if err is not None:
            raise TransferFailed(f"tcp peer {peer[0]}:{peer[1]} refused {body.get('kind')!r}: {err}")
        return reply

    def _control_response(self, sock: socket.socket, req_id: int, deadline: Deadline) -> tuple[str | None, dict]:
        """(error text or None, reply) of the response to control request ``req_id``. A refusal instead raises
        AuthError (a server with a secret refused us) or TransferFailed (over a connection cap, with its reason)."""
        prefix = recv_exact(sock, wire.PREFIX.size, deadline.at)
        try:
            hlen, plen = wire.parse_prefix(prefix, self._cfg.max_frame)
        except ProtocolError:
            handshake.check_refused(prefix, "the peer")
            raise
        header = recv_exact(sock, hlen, deadline.at)
        if plen:
            raise ProtocolError(f"a control response carries no payload, got {plen} bytes")
        try:
            return wire.decode_control_response(header, req_id)
        except ProtocolError:
            _check_refused(header)
            raise

    def _acquire(self, peer: tuple[str, int], deadline: Deadline, fresh: bool) -> tuple[socket.socket, bool]:
        """(a connected, authenticated socket to ``peer``, whether it came from the pool)."""
        left = deadline.remaining()
        if left <= 0:
            raise TimeoutError("deadline passed before connecting")
        sock = None if fresh else self._pooled(peer)
        if sock is not None:
            return sock, True
        sock = socket.create_connection(peer, timeout=left)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._secret is not None:
            handshake.client(sock, self._secret, deadline.at, "the peer", refused=_refusal_frame)
        return sock, False

    def _pooled(self, peer: tuple[str, int]) -> socket.socket | None:
        """An idle pooled connection to ``peer``, or None. One the server closed meanwhile
        (transfer.idle_timeout_ms, a restart) fails before any reply byte, and its spans are retried on a fresh
        connection (native RETRY); a control request checks first (``reusable``), it has no retry."""
        fd = self.peers.take(_peer_key(peer))
        return None if fd < 0 else socket.socket(fileno=fd)

    def _release(self, peer: tuple[str, int], sock: socket.socket) -> None:
        """Back to the idle pool (the native table owns the fd from then on), or closed when it is full."""
        fd = sock.detach()
        if not self.peers.give(_peer_key(peer), fd):
            os.close(fd)

    def _drop_idle(self, peer: tuple[str, int]) -> None:
        for fd in self.peers.drop(_peer_key(peer)):
            os.close(fd)

    def close(self) -> None:
        self._server.close()
        self.fast.clear()
        for fd in self.peers.clear():
            os.close(fd)
        self._peers_io.shutdown(wait=False)


def _peer_key(peer: tuple[str, int]) -> str:
    """A peer's name in the native pool (``host:port``)."""
    return f"{peer[0]}:{peer[1]}"


def _abort(sock: socket.socket) -> None:
    """Close a connection that failed mid-batch with a reset (SO_LINGER 0): the kernel drops the bytes it has not
    sent yet instead of delivering them once the peer or the link wakes up. A write its caller was told failed
    must not land later: the store may have handed that space to another object by then."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _connections(total: int, n: int, limit: int, conns: int) -> int:
    """How many connections a batch of ``n`` spans and ``total`` bytes uses: one per frame the native planner
    cuts, at most ``conns``."""
    target = min(limit, max(MIN_PIECE, -(-total // conns)))
    frames = max(-(-total // target), -(-n // wire.MAX_ENTRIES), 1)
    return max(1, min(conns, frames))


def _auth_refused(peer: tuple[str, int], prefix_hex: str, deadline: Deadline) -> TransferFailed:
    """The failure for a peer that answered a frame with a handshake message (it has a shared secret and we
    have none): TransferFailed caused by the handshake's AuthError."""
    try:
        handshake.check_refused(bytes.fromhex(prefix_hex), "the peer")
    except AuthError as e:
        return _failure(peer, e, deadline)
    return TransferFailed(
        f"tcp peer {peer[0]}:{peer[1]} failed: ProtocolError: bad frame magic (an authentication "
        f"handshake: the peer has a shared secret, this process has none)"
    )


def _refusal_frame(data: bytes) -> TransferFailed | None:
    """The TransferFailed naming the reason when ``data`` (sent instead of a handshake message) is the server's
    refusal frame (over a connection cap, tcp_server.py), else None."""
    try:
        hlen, _ = wire.parse_prefix(data[: wire.PREFIX.size], 1 << 20)
        _check_refused(data[wire.PREFIX.size : wire.PREFIX.size + hlen])
    except TransferFailed as e:
        return e
    except (ProtocolError, ValueError):
        pass
    return None


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
