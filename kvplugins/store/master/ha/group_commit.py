"""Group commit for an HA master: the replies of every op served in one turn of RpcServer's loop are held until
their metadata writes are persisted in etcd by one ``service.sync()`` (one transaction per 128 keys for the
whole turn instead of one per op), then sent. If the writes cannot be persisted the held connections are
closed and the zmq replies dropped: nothing unpersisted is ever acknowledged, and clients retry.

RpcServer uses this when its service has ``sync`` (ha.leader.LeaderGuard); a plain master gets ``Immediate``, the
same interface sending every reply at once.
Follows the classic database group commit (a log flush shared by every transaction waiting on it).
"""

from __future__ import annotations

import logging

from kvplugins.errors import StoreError

log = logging.getLogger(__name__)


class GroupCommit:
    """Held replies of one loop turn of ``server`` (an RpcServer)."""

    def __init__(self, server):
        self.server = server
        self.conns: set = set()  # raw connections whose outbuf holds unsent replies
        self.zmq: list[list[bytes]] = []  # ROUTER replies not yet sent
        server.service.grouped = True

    def hold(self, conn) -> None:
        self.conns.add(conn)

    def holds(self, conn) -> bool:
        return conn in self.conns

    def send_zmq(self, parts: list[bytes]) -> None:
        self.zmq.append(parts)

    def sync(self) -> None:
        """Persist this turn's writes, then send (or, on failure, drop) the held replies."""
        conns, msgs, self.conns, self.zmq = self.conns, self.zmq, set(), []
        try:
            self.server.service.sync()
            failed = None
        except StoreError as e:
            failed = f"metadata not persisted, replies withheld: {e}"
            log.warning("%s (%d connections, %d control messages)", failed, len(conns), len(msgs))
        for conn in conns:
            self.server.release(conn, failed)
        if failed is None:
            for parts in msgs:
                self.server.send_control(parts)


class Immediate:
    """A plain master's replies: sent at once (GroupCommit's interface, nothing held)."""

    def __init__(self, server):
        self.server = server

    def hold(self, conn) -> None:
        self.server.release(conn)

    def holds(self, conn) -> bool:
        return False

    def send_zmq(self, parts: list[bytes]) -> None:
        self.server.send_control(parts)

    def sync(self) -> None:
        pass


def for_server(server) -> GroupCommit | Immediate:
    """A GroupCommit when ``server.service`` persists in batches (has ``sync``), else Immediate."""
    return GroupCommit(server) if hasattr(type(server.service), "sync") else Immediate(server)
