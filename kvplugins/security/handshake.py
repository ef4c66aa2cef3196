"""Mutual challenge-response authentication of a TCP connection, once, before its first frame.

Used by the master's raw RPC endpoint (roles client, node, admin), the transfer core's TCP data connections and
the disk tier's promote endpoint (role data); always on (the per-user default secret when none is configured).
Every message is MSG (72 bytes): magic b"KVPA", version, kind, reason (HELLO: the role claimed, security/roles.py
RANK), name length (HELLO: the credential's name follows the message; 0 for a secret holder), a 32-byte nonce, a
32-byte MAC. K = the key of the claimed role under that name (secret.py: derived one-way from the cluster
secret; a role credential holds only its own):

    client -> server  HELLO      role, name, nonce = cn (random)
    server -> client  CHALLENGE  nonce = sn (random), mac = HMAC(K, "S" + cn + sn)   (the server proves itself)
    client -> server  PROOF      mac = HMAC(K, "C" + sn + cn)                        (the client proves the role)
    server -> client  ACCEPTED   -- frames follow as usual, role and name fixed; or REFUSED (reason) and the server
                                    closes.

The secret never goes on the wire; nonces from ``secrets`` make every exchange fresh (no replay), the "S"/"C"
labels keep one side's answer from being reflected as the other's, MACs are compared in constant time. A peer
that sends anything else first (a frame, a pickle) gets REFUSED(NOT_AUTHENTICATED) and is closed unserved.
This authenticates; it does not encrypt (operations.md, Security).
"""

from __future__ import annotations

import hmac
import secrets
import socket
import struct
import time

from kvplugins.errors import AuthError, Forbidden
from kvplugins.security.roles import MASTER_ROLES, RANK, ROLES
from kvplugins.security.secret import HOW, NAME, Credential, Secret, named_key

MAGIC = b"KVPA"
VERSION = 2
MSG = struct.Struct("<4sBBBB32s32s")
HELLO, CHALLENGE, PROOF, ACCEPTED, REFUSED = 1, 2, 3, 4, 5
BAD_PROOF, NOT_AUTHENTICATED, BAD_MESSAGE, BAD_ROLE = 1, 2, 3, 4
_ZERO = bytes(32)
DEADLINE_S = 5.0  # a connection must finish the handshake this soon after it opened (then it is dropped)
_REASONS = {
    BAD_PROOF: "its shared secret differs from this process's",
    NOT_AUTHENTICATED: "it requires authentication and this process has no shared secret configured",
    BAD_MESSAGE: "the authentication exchange was malformed (a different kvplugins version?)",
    BAD_ROLE: "it serves no connection of the role this process claimed",
}


def message(kind: int, nonce: bytes = _ZERO, mac: bytes = _ZERO, reason: int = 0, name: bytes = b"") -> bytes:
    return MSG.pack(MAGIC, VERSION, kind, reason, len(name), nonce, mac) + name


def refusal_error(peer: str, reason: int) -> AuthError:
    """The AuthError a client raises when ``peer`` refused it."""
    return AuthError(f"{peer} refused this connection: {_REASONS.get(reason, f'reason {reason}')}; {HOW}")


def check_refused(data: bytes | bytearray | memoryview, peer: str) -> None:
    """Raise the client's AuthError if ``data`` (at least the first 7 bytes a server answered instead of a
    frame) starts a REFUSED message: a client without a secret learns why it was closed."""
    if bytes(data[:4]) == MAGIC and len(data) >= 7:
        _, kind, reason = struct.unpack_from("<BBB", data, 4)
        raise refusal_error(peer, reason if kind == REFUSED else BAD_MESSAGE)


class ServerHandshake:
    """The server side of one connection, fed the bytes received so far (blocking or non-blocking sockets),
    accepting the ``roles`` whose keys ``keys`` (a Secret or Credential) gives. After it passed, ``role`` is the
    role the peer proved; after it failed, ``reason`` says why (for the log line naming the peer)."""

    def __init__(self, keys: Secret | Credential, roles: tuple[str, ...] = MASTER_ROLES):
        self._keys, self._roles, self._sn, self._cn = keys, roles, secrets.token_bytes(32), b""
        self._want, self._key = HELLO, b""
        self.reason = self.role = self.name = ""
        self.deadline = time.monotonic() + DEADLINE_S

    def overdue(self, now: float) -> bool:
        """True once the peer has had DEADLINE_S to authenticate (a silent or trickling peer); sets ``reason``."""
        if now < self.deadline:
            return False
        self.reason = f"it did not authenticate within {DEADLINE_S:g} s"
        return True

    def feed(self, buf: bytearray) -> tuple[bytes, bool | None]:
        """Consume handshake messages from the front of ``buf``. Returns (bytes to send, outcome): outcome
        None = send and wait for more, True = authenticated (frames follow), False = refused (send, then close)."""
        if buf[:4] != MAGIC[: len(buf[:4])]:
            return self._refuse(NOT_AUTHENTICATED, "it sent data without authenticating")
        if len(buf) < MSG.size:
            return b"", None
        magic, version, kind, code, n, nonce, mac = MSG.unpack_from(buf)
        n = n if kind == HELLO else 0
        if len(buf) < MSG.size + n:
            return b"", None
        name = bytes(buf[MSG.size : MSG.size + n])
        del buf[: MSG.size + n]
        if kind == REFUSED and version == VERSION:
            return self._refuse(BAD_PROOF, "wrong shared secret (it rejected this server's proof)")
        if version != VERSION or kind != self._want:
            return self._refuse(BAD_MESSAGE, f"unexpected handshake message (version {version}, kind {kind})")
        if kind == HELLO:
            role = ROLES[code] if code < len(ROLES) else f"#{code}"
            key = self._keys.key(role) if role in self._roles else None
            if key is None:
                return self._refuse(BAD_ROLE, f"it claimed role {role}; this endpoint serves {', '.join(self._roles)}")
            if name:
                if (
                    role == "data"
                    or not isinstance(self._keys, Secret)
                    or not NAME.fullmatch(name.decode("ascii", "replace"))
                ):
                    return self._refuse(
                        BAD_MESSAGE,
                        f"it claimed role {role} under the name {name[:64]!r}, which this endpoint does not serve",
                    )
                self.name, key = name.decode(), named_key(key, name.decode())
            self._cn, self._want, self._key, self.role = nonce, PROOF, key, role
            out = message(CHALLENGE, self._sn, _mac(key, b"S", self._cn, self._sn))
            if buf:
                more, outcome = self.feed(buf)
                return out + more, outcome
            return out, None
        if not hmac.compare_digest(mac, _mac(self._key, b"C", self._sn, self._cn)):
            return self._refuse(BAD_PROOF, f"wrong shared secret or {self.role} credential")
        return message(ACCEPTED), True

    @property
    def identity(self) -> str:
        """``role:name`` of a peer that proved a named credential; "" for a secret holder (the cluster)."""
        return f"{self.role}:{self.name}" if self.name else ""

    def _refuse(self, reason: int, text: str) -> tuple[bytes, bool]:
        self.reason = text
        return message(REFUSED, reason=reason), False


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), "sha256").digest()


def serve_blocking(
    sock: socket.socket, keys: Secret | Credential, timeout_s: float, roles: tuple[str, ...] = ("data",)
) -> str | None:
    """Run the server side on a blocking socket (a transfer or disk-tier peer: role data). Returns None when
    authenticated, else the refusal reason (the refusal was sent; the caller logs and closes). Raises
    OSError/TimeoutError (peer gone or silent)."""
    hs, buf = ServerHandshake(keys, roles), bytearray()
    deadline = time.monotonic() + timeout_s
    while True:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = sock.recv(MSG.size - len(buf))  # never past a message: frames follow
        if not chunk:
            raise ConnectionError("peer closed the connection during authentication")
        buf += chunk
        out, outcome = hs.feed(buf)
        if out:
            sock.sendall(out)
        if outcome is True:
            return None
        if outcome is False:
            return hs.reason


def client(
    sock: socket.socket, keys: Secret | Credential, deadline: float, peer: str, role: str = "data", refused=None
) -> None:
    """Authenticate a freshly connected blocking socket to ``peer`` (e.g. "master 10.0.0.1:5555") as ``role``
    by ``deadline`` (time.monotonic()); on failure the socket is closed. ``refused(data) -> Exception | None``
    decodes what a server sends instead of a handshake message (its own refusal frame: over a connection cap)
    into the error to raise. Raises Forbidden (``keys`` has no key for ``role``), AuthError (refused, or the
    peer could not prove it holds the secret), that decoded error, TimeoutError/OSError."""
    try:
        key = keys.key(role)
        if key is None:
            raise Forbidden(
                f"connecting to {peer} as {role} needs the cluster secret or a {role} credential; "
                f"{keys.source} gives the {keys.role} role only"
            )
        name = keys.name.encode() if role == keys.role else b""
        _client(sock, key, RANK[role], name, deadline, peer, refused)
    except BaseException:
        sock.close()
        raise


def _client(sock: socket.socket, key: bytes, role: int, name: bytes, deadline: float, peer: str, refused) -> None:
    cn = secrets.token_bytes(32)
    _send(sock, message(HELLO, cn, reason=role, name=name), deadline)
    kind, reason, sn, mac = _receive(sock, deadline, peer, refused)
    if kind == REFUSED:
        raise refusal_error(peer, reason)
    if kind != CHALLENGE or not hmac.compare_digest(mac, _mac(key, b"S", cn, sn)):
        try:
            _send(sock, message(REFUSED, reason=BAD_PROOF), deadline)  # so the server logs the refusal too
        except OSError:
            pass
        raise AuthError(
            f"{peer} could not prove it holds this process's shared secret (its secret differs, or it "
            f"is not a kvplugins peer); {HOW}"
        )
    _send(sock, message(PROOF, mac=_mac(key, b"C", sn, cn)), deadline)
    kind, reason, _, _ = _receive(sock, deadline, peer, refused)
    if kind != ACCEPTED:
        raise refusal_error(peer, reason if kind == REFUSED else BAD_MESSAGE)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_left(deadline))
    sock.sendall(data)


def _receive(sock: socket.socket, deadline: float, peer: str, refused) -> tuple[int, int, bytes, bytes]:
    buf = bytearray()
    while len(buf) < MSG.size:
        sock.settimeout(_left(deadline))
        chunk = sock.recv(MSG.size - len(buf))
        if not chunk:
            raise AuthError(
                f"{peer} closed the connection during authentication: it has no shared secret "
                f"configured (or is not a kvplugins peer); {HOW}"
            )
        buf += chunk
        if buf[:4] != MAGIC[: len(buf[:4])]:
            err = refused(_rest(sock, buf, deadline)) if refused is not None else None
            if err is not None:
                raise err
            raise AuthError(
                f"{peer} answered the authentication with something else: it has no shared secret "
                f"configured (or is not a kvplugins peer); {HOW}"
            )
    magic, version, kind, reason, _, nonce, mac = MSG.unpack(buf)
    return (kind, reason, nonce, mac) if version == VERSION else (REFUSED, BAD_MESSAGE, nonce, mac)


def _rest(sock: socket.socket, buf: bytearray, deadline: float, limit: int = 1 << 16) -> bytes:
    """``buf`` and what the peer sends after it until it closes (at most ``limit`` bytes, until ``deadline``)."""
    try:
        while len(buf) < limit:
            sock.settimeout(_left(deadline))
            chunk = sock.recv(limit - len(buf))
            if not chunk:
                break
            buf += chunk
    except (OSError, TimeoutError):
        pass
    return bytes(buf)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("authentication did not finish in time")
    return left
