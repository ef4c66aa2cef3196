"""Test helpers for the shared secret: choose this process's secret (env vars, through a MonkeyPatch) and read
what a server answers on a raw socket until it closes it."""
from __future__ import annotations

import socket

TOKEN_ENV, FILE_ENV = "KVPLUGINS_AUTH_TOKEN", "KVPLUGINS_AUTH_TOKEN_FILE"


def use_secret(mp, token: str | None = None, token_file: str | None = None) -> None:
    """From now on (until ``mp`` undoes it) components built in this process, and processes it starts, use
    ``token`` or ``token_file`` as the shared secret; neither = no secret."""
    for name, value in ((TOKEN_ENV, token), (FILE_ENV, token_file)):
        if value is None:
            mp.delenv(name, raising=False)
        else:
            mp.setenv(name, str(value))


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes the connection (a reset ends it too)."""
    out = b""
    try:
        while chunk := sock.recv(1 << 16):
            out += chunk
    except ConnectionResetError:
        pass
    return out
