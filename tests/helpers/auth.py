"""Test helpers for the shared secret: choose this process's secret (env vars, through a MonkeyPatch) and read
what a server answers on a raw socket until it closes it."""

from __future__ import annotations

import socket
import time

TOKEN_ENV, FILE_ENV = "KVPLUGINS_AUTH_TOKEN", "KVPLUGINS_AUTH_TOKEN_FILE"


NO_HOME = "/proc/kvplugins-no-config-home"  # a config folder no process can create: no per-user secret


def use_secret(mp, token: str | None = None, token_file: str | None = None, none: bool = False) -> None:
    """From now on (until ``mp`` undoes it) components built in this process, and processes it starts, use
    ``token`` or ``token_file`` as the shared secret; neither = the per-user default secret
    (security/secret.py), or with ``none`` no credential at all (its config folder cannot be created)."""
    for name, value in ((TOKEN_ENV, token), (FILE_ENV, token_file)):
        if value is None:
            mp.delenv(name, raising=False)
        else:
            mp.setenv(name, str(value))
    if none:
        mp.setenv("XDG_CONFIG_HOME", NO_HOME)


def authenticated(sock: socket.socket, role: str = "admin") -> socket.socket:
    """``sock`` after the handshake (security/handshake.py) as ``role`` with this process's credential: what a
    raw-socket test needs before its frames reach a master (any op: admin) or a transfer server (role data)."""
    from kvplugins.security import handshake, load_secret

    handshake.client(sock, load_secret(), time.monotonic() + 5, "test peer", role)
    sock.settimeout(10)
    return sock


def zmq_endpoint(master: str) -> str:
    """The master's zmq control-plane endpoint (asked on its raw endpoint with this process's credential)."""
    from kvplugins.store.client.connect import control_client

    ctl = control_client(master, 3000)
    try:
        return ctl.address
    finally:
        ctl.close()


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes the connection (a reset ends it too)."""
    out = b""
    try:
        while chunk := sock.recv(1 << 16):
            out += chunk
    except ConnectionResetError:
        pass
    return out
