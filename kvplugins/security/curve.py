"""The master's zmq control plane under CURVE, with keys derived from the shared secret.

Why CURVE (and not PLAIN or a MAC per message): CURVE is libzmq's own authenticated, encrypted handshake
(libsodium), done once per connection, with no code of ours on the message path and no replay window. The
server's key pair is derived one-way from the secret (HMAC-SHA256 -> Curve25519 secret key), so only holders
of the secret know the server's public key, which a client needs to complete the handshake; the server's
answer proves it holds the matching secret key. Clients use a fresh key pair per socket. PLAIN would put the
secret on the wire; a MAC per message needs our own replay protection.

Refused peers never reach the ROUTER; a socket monitor logs each failed handshake with the peer's address.
"""
from __future__ import annotations

import os
import socket
import threading

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from kvplugins.errors import AuthError
from kvplugins.security.refusals import RefusalLog
from kvplugins.security.secret import HOW, Secret

FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def server_keys(secret: Secret) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE keys of the master, derived from ``secret``."""
    private = z85.encode(secret.derive(b"zmq-curve-server"))
    return zmq.curve_public(private), private


def client_socket(sock: zmq.Socket, secret: Secret | None) -> None:
    """Make ``sock`` (before connect) a CURVE client of a master using ``secret``; no-op without one."""
    if secret is None:
        return
    public, private = zmq.curve_keypair()
    sock.curve_serverkey = server_keys(secret)[0]
    sock.curve_publickey, sock.curve_secretkey = public, private


def handshake_failed(monitor: zmq.Socket | None) -> bool:
    """Whether a client socket's ``monitor`` (see client_monitor) recorded a failed handshake."""
    failed = False
    while monitor is not None and monitor.poll(0):
        failed |= bool(recv_monitor_message(monitor)["event"] & FAILED)
    return failed


def client_monitor(sock: zmq.Socket) -> zmq.Socket:
    """A monitor of ``sock``'s handshakes, so a client that times out can tell a refusal from silence."""
    return sock.get_monitor_socket(FAILED)


def refused_error(endpoint: str) -> AuthError:
    return AuthError(f"master control plane {endpoint} refused the connection (CURVE handshake failed): this "
                     f"process's shared secret is missing or differs from the master's; {HOW}")


class CurveServer:
    """Turns a ROUTER (before bind) into a CURVE server for ``secret`` and logs refused peers from a monitor
    thread. ``close()`` before the socket's context is terminated."""

    def __init__(self, router: zmq.Socket, secret: Secret):
        router.curve_server = True
        router.curve_publickey, router.curve_secretkey = server_keys(secret)
        self._router, self.refusals = router, RefusalLog()
        self._monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | FAILED)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvp-zmq-auth-log", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        peers: dict[int, str] = {}
        failed: list[str] = []            # libzmq reports a failed handshake, then the DISCONNECTED of its fd
        while not self._stop.is_set():
            if not self._monitor.poll(100):
                continue
            ev = recv_monitor_message(self._monitor)
            if ev["event"] == zmq.EVENT_ACCEPTED:
                peers[ev["value"]] = _peer_of(ev["value"])
            elif ev["event"] & FAILED:
                failed.append(_describe(ev))
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                peer = peers.pop(ev["value"], "?:?")
                if failed:
                    self.refusals.refused("zmq control-plane connection", peer,
                                          f"{failed.pop(0)}: missing or wrong shared secret")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            self._router.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)


def _peer_of(fd: int) -> str:
    """host:port of the connection on ``fd`` (best effort: it may already be closed)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            host, port = s.getpeername()[:2]
            return f"{host}:{port}"
    except OSError:
        return "?:?"


def _describe(ev: dict) -> str:
    kind = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error (no CURVE, or a different server key)",
            zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication failed"}.get(ev["event"], "handshake failed")
    return f"{kind} (code {ev['value']:#x})"
