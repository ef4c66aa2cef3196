"""Socket loops without per-byte Python work: gather sends and scatter receives of memoryviews that
point straight into registered memory (sendmsg / recvmsg_into, at most IOV_MAX buffers a call).

Blocking calls release the GIL (CPython socket calls). Each call is bounded by the socket's timeout;
with ``deadline`` (time.monotonic() seconds) a loop also stops once the deadline has passed, so a peer
trickling bytes cannot stretch a transfer past about twice its timeout. Errors: TimeoutError, OSError;
a peer closing mid-message raises ConnectionError.
"""

from __future__ import annotations

import select
import socket
import time

IOV_MAX = 1024
CALL_BYTES = 4 << 20


def _views(buffers: list) -> list[memoryview]:
    return [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]


class _Cursor:
    """Position in a list of views; ``window()`` is what one sendmsg/recvmsg_into call gets: at most
    IOV_MAX views and about CALL_BYTES bytes, so a call never touches every buffer of a large list."""

    def __init__(self, views: list[memoryview]):
        self.views, self.i = views, 0

    def __bool__(self) -> bool:
        return self.i < len(self.views)

    def window(self) -> list[memoryview]:
        total, j, end = 0, self.i, min(len(self.views), self.i + IOV_MAX)
        while j < end and total < CALL_BYTES:
            total += len(self.views[j])
            j += 1
        return self.views[self.i : j]

    def advance(self, done: int) -> None:
        views = self.views
        while done and done >= len(views[self.i]):
            done -= len(views[self.i])
            self.i += 1
        if done:
            views[self.i] = views[self.i][done:]

    def left(self) -> int:
        return sum(len(v) for v in self.views[self.i :])


def _check(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError("transfer deadline passed mid-message")


def send_all(sock: socket.socket, buffers: list, deadline: float | None = None) -> None:
    """Send every buffer in order with sendmsg (scatter/gather, no joining into one bytes object)."""
    cur = _Cursor(_views(buffers))
    while cur:
        cur.advance(sock.sendmsg(cur.window()))
        if cur:
            _check(deadline)


def recv_views(sock: socket.socket, buffers: list, deadline: float | None = None) -> None:
    """Fill every buffer completely, in order, with recvmsg_into (scatter receive)."""
    cur = _Cursor(_views(buffers))
    while cur:
        got = sock.recvmsg_into(cur.window())[0]
        if got == 0:
            raise ConnectionError(f"peer closed the connection with {cur.left()} bytes still expected")
        cur.advance(got)
        if cur:
            _check(deadline)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> memoryview:
    """Receive exactly ``n`` bytes into a new buffer."""
    buf = memoryview(bytearray(n))
    recv_views(sock, [buf], deadline)
    return buf


def reusable(sock: socket.socket) -> bool:
    """True if an idle pooled connection may carry the next request: the peer has not closed it (an idle
    timeout) and sent nothing unasked (a refusal). A zero-timeout poll, one syscall; ``select.poll`` has no
    descriptor-number limit."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    try:
        return not poller.poll(0)
    except OSError:
        return False
