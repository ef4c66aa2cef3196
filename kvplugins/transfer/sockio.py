"""Socket loops without per-byte Python work: gather sends and scatter receives of memoryviews that
point straight into registered memory (sendmsg / recvmsg_into, at most IOV_MAX buffers a call).

Blocking calls release the GIL (CPython socket calls). Each call is bounded by the socket's timeout;
with ``deadline`` (time.monotonic() seconds) a loop also stops once the deadline has passed, so a peer
trickling bytes cannot stretch a transfer past about twice its timeout. Errors: TimeoutError, OSError;
a peer closing mid-message raises ConnectionError.
"""
from __future__ import annotations

import socket
import time

IOV_MAX = 1024


def _views(buffers: list) -> list[memoryview]:
    return [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """Drop ``done`` bytes from the front of ``views``."""
    i = 0
    while i < len(views) and done >= len(views[i]):
        done -= len(views[i])
        i += 1
    rest = views[i:]
    if rest and done:
        rest[0] = rest[0][done:]
    return rest


def _check(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError("transfer deadline passed mid-message")


def send_all(sock: socket.socket, buffers: list, deadline: float | None = None) -> None:
    """Send every buffer in order with sendmsg (scatter/gather, no joining into one bytes object)."""
    views = _views(buffers)
    while views:
        views = _advance(views, sock.sendmsg(views[:IOV_MAX]))
        if views:
            _check(deadline)


def recv_views(sock: socket.socket, buffers: list, deadline: float | None = None) -> None:
    """Fill every buffer completely, in order, with recvmsg_into (scatter receive)."""
    views = _views(buffers)
    total = sum(len(v) for v in views)
    while views:
        got = sock.recvmsg_into(views[:IOV_MAX])[0]
        if got == 0:
            raise ConnectionError(f"peer closed the connection with {sum(len(v) for v in views)} of "
                                  f"{total} bytes outstanding")
        views = _advance(views, got)
        if views:
            _check(deadline)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> memoryview:
    """Receive exactly ``n`` bytes into a new buffer."""
    buf = memoryview(bytearray(n))
    recv_views(sock, [buf], deadline)
    return buf
