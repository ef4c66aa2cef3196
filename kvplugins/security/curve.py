"""The master's zmq control plane under CURVE, with keys derived from the shared secret, one client key per role.

Why CURVE (and not PLAIN or a MAC per message): CURVE is libzmq's own authenticated, encrypted handshake
(libsodium), done once per connection, with no code of ours on the message path and no replay window. The
server's key pair is derived one-way from the secret (HMAC-SHA256 -> Curve25519 secret key), so only holders
of the secret know the server's public key, which a client needs to complete the handshake; the server's
answer proves it holds the matching secret key. A client's long-term key pair is derived from its role's key
(security/roles.py): one pair per role for holders of the secret, another per role shared by that role's
credentials (secret.py). The master's ZAP handler (a thread of this module, on the ROUTER's context) accepts only
those public keys and stamps each message's User-Id with the role (``client``) or, for a credential's key, the
role's credential identity (``client:*``: every credential of the role shares that per-identity budget on this
plane; master/quotas.py), which the dispatcher checks per op. CURVE's per-session keys stay ephemeral. PLAIN would put the secret on the wire; a MAC
per message needs our own replay protection.

Refused peers never reach the ROUTER; a socket monitor logs each failed handshake with the peer's address.
"""

from __future__ import annotations

import os
import socket
import threading

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from kvplugins.errors import AuthError, Forbidden
from kvplugins.security.refusals import RefusalLog
from kvplugins.security.roles import MASTER_ROLES
from kvplugins.security.secret import HOW, Credential, Secret, credential_curve_secret

ZAP_ENDPOINT = "inproc://zeromq.zap.01"

FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def server_keys(secret: Secret) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE keys of the master, derived from ``secret``."""
    private = z85.encode(secret.derive(b"zmq-curve-server"))
    return zmq.curve_public(private), private


def client_keys(keys: Secret | Credential, role: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE keys of a ``role`` client, derived from that role's key. Raises Forbidden when
    ``keys`` has no key for ``role``."""
    private = keys.curve_secret(role)
    if private is None:
        raise Forbidden(
            f"the master's control plane as {role} needs the cluster secret or a {role} credential; "
            f"{keys.source} gives the {keys.role} role only"
        )
    return zmq.curve_public(private), private


def client_socket(sock: zmq.Socket, keys: Secret | Credential | None, role: str = "client") -> None:
    """Make ``sock`` (before connect) a CURVE client of a master as ``role``. Without ``keys`` the socket stays
    plain (the master refuses it). Raises Forbidden (no key for ``role``)."""
    if keys is None:
        return
    sock.curve_serverkey = server_keys(keys)[0] if isinstance(keys, Secret) else keys.curve_server
    sock.curve_publickey, sock.curve_secretkey = client_keys(keys, role)


def server_socket(sock: zmq.Socket, secret: Secret) -> None:
    """Make ``sock`` (before bind) a CURVE server for ``secret`` that admits only role keys, through the ZAP
    handler of the CurveServer running on the same context (the master's KV event PUB and replay ROUTER)."""
    sock.zap_domain = b"kvplugins"
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = server_keys(secret)


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
    return AuthError(
        f"master control plane {endpoint} refused the connection (CURVE handshake failed): this "
        f"process's shared secret is missing or differs from the master's; {HOW}"
    )


def caller_of(frame: zmq.Frame) -> tuple[str, str]:
    """(role, identity) the ZAP handler stamped on a message received by a CurveServer's ROUTER: identity ""
    for a secret holder, ``role:*`` for a role credential; ("", "") if none."""
    try:
        stamp = frame.get("User-Id")
    except zmq.ZMQError:
        return "", ""
    role, _, rest = stamp.partition(":")
    return role, stamp if rest else ""


class CurveServer:
    """Turns a ROUTER (before bind) into a CURVE server for ``secret`` that admits the role keys only, stamping
    each message's User-Id with the role (caller_of), and logs refused peers. One thread serves the ZAP requests
    and the monitor; ``close()`` joins it, before the socket's context is terminated."""

    def __init__(self, router: zmq.Socket, secret: Secret):
        self._zap = router.context.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._roles = {client_keys(secret, r)[0]: r.encode() for r in MASTER_ROLES}
        self._roles.update(
            {zmq.curve_public(credential_curve_secret(secret, r)): f"{r}:*".encode() for r in MASTER_ROLES}
        )
        server_socket(router, secret)
        self._router, self.refusals = router, RefusalLog()
        self._monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | FAILED)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvp-zmq-auth", daemon=True)
        self._thread.start()

    def _answer_zap(self) -> None:
        """One ZAP request (RFC 27): admit a CURVE client whose long-term key is a role's, as that role."""
        req = self._zap.recv_multipart()
        version, rid = req[0], req[1] if len(req) > 1 else b""
        role = self._roles.get(z85.encode(req[6])) if len(req) >= 7 and req[5] == b"CURVE" else None
        if role is None:
            self._zap.send_multipart([version, rid, b"400", b"not a kvplugins role key", b"", b""])
        else:
            self._zap.send_multipart([version, rid, b"200", b"OK", role, b""])

    def _watch(self) -> None:
        peers: dict[int, str] = {}
        failed: list[str] = []  # libzmq reports a failed handshake, then the DISCONNECTED of its fd
        poller = zmq.Poller()
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._zap, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self._zap in ready:
                self._answer_zap()
            if self._monitor not in ready:
                continue
            ev = recv_monitor_message(self._monitor)
            if ev["event"] == zmq.EVENT_ACCEPTED:
                peers[ev["value"]] = _peer_of(ev["value"], ev["endpoint"])
            elif ev["event"] & FAILED:
                failed.append(_describe(ev))
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                peer = peers.pop(ev["value"], UNKNOWN_PEER)
                if failed:
                    self.refusals.refused(
                        "zmq control-plane connection", peer, f"{failed.pop(0)}: missing or wrong shared secret"
                    )

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._router.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self._zap.close(0)


UNKNOWN_PEER = "a peer that closed before its address was read"


def _peer_of(fd: int, listening: bytes) -> str:
    """host:port of the connection libzmq accepted on ``fd`` from its ``listening`` endpoint (``tcp://h:port``).
    Best effort: a refused client may close first, and its fd number may then belong to another socket, so an
    fd not bound to the listening port reads as UNKNOWN_PEER rather than someone else's address."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            if str(s.getsockname()[1]) != listening.decode().rsplit(":", 1)[-1]:
                return UNKNOWN_PEER
            host, port = s.getpeername()[:2]
            return f"{host}:{port}"
    except (OSError, TypeError, IndexError):
        return UNKNOWN_PEER


def _describe(ev: dict) -> str:
    kind = {
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error (no CURVE, or a different server key)",
        zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication failed",
    }.get(ev["event"], "handshake failed")
    return f"{kind} (code {ev['value']:#x})"
