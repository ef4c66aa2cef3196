"""Socket loops without per-byte Python work: gather sends of memoryviews, receives straight into memory.

Blocking calls release the GIL (CPython socket calls). Errors propagate as OSError / TimeoutError;
a peer closing mid-message raises ConnectionError.
"""
from __future__ import annotations

import socket

IOV_MAX = 1024
_SCRATCH = 1 << 20


def send_all(sock: socket.socket, buffers: list) -> None:
    """Send every buffer in order with sendmsg (scatter/gather, no joining into one bytes object)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views[:IOV_MAX])
        while sent and views:
            n = len(views[0])
            if sent >= n:
                sent -= n
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def recv_into_all(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from the socket."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k


def recv_exact(sock: socket.socket, n: int) -> memoryview:
    """Receive exactly ``n`` bytes into a new buffer."""
    buf = memoryview(bytearray(n))
    recv_into_all(sock, buf)
    return buf


def discard(sock: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes (the payload of a rejected entry) through a bounded scratch buffer."""
    scratch = memoryview(bytearray(min(n, _SCRATCH)))
    while n > 0:
        k = min(n, len(scratch))
        recv_into_all(sock, scratch[:k])
        n -= k
