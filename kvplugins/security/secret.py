"""The cluster's shared secret: its config component, loading, and the rule that a non-loopback bind needs it.

One secret per cluster, given to every master, store node and client: ``KVPLUGINS_AUTH_TOKEN_FILE`` (a file
holding it, mode 0600) or ``KVPLUGINS_AUTH_TOKEN`` (the value itself), or ``--token-file`` / an ``[auth]``
table in the config file; precedence flag > env > file > default (kvplugins.config.load). The secret itself
never goes on the wire: connections prove they hold it with HMAC-SHA256 challenges (handshake.py) and the
zmq control plane derives its CURVE keys from it (curve.py).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, field

from kvplugins.config import component, load
from kvplugins.errors import ConfigError

log = logging.getLogger("kvplugins.security")
MIN_SECRET = 16
NEW_SECRET = ("python -c 'import secrets; print(secrets.token_hex(32))' > /etc/kvplugins/token && "
              "chmod 600 /etc/kvplugins/token")
HOW = ("give every master, node and client of the cluster the same secret: KVPLUGINS_AUTH_TOKEN_FILE=<file> "
       "(or --token-file, or token_file in the [auth] table of the config file)")


@component("auth")
@dataclass(frozen=True)
class AuthConfig:
    """The shared secret (env KVPLUGINS_AUTH_TOKEN / KVPLUGINS_AUTH_TOKEN_FILE). Empty = no authentication,
    which is allowed only while every endpoint binds a loopback address."""
    token: str = field(default="", metadata={
        "help": "the shared secret itself (prefer token_file: a value in the environment or on a command line "
                "is visible to other processes of the same user)"})
    token_file: str = field(default="", metadata={"help": "file holding the shared secret (keep it mode 0600)"})

    def __post_init__(self) -> None:
        if self.token and self.token_file:
            raise ConfigError("auth: both token and token_file are set; give only one (token_file is preferred)")


class Secret:
    """A shared secret (at least MIN_SECRET bytes). Its value is never printed; ``source`` says where it came from."""
    __slots__ = ("_key", "source")

    def __init__(self, key: bytes, source: str):
        if len(key) < MIN_SECRET:
            raise ConfigError(f"the shared secret from {source} has {len(key)} bytes; use at least {MIN_SECRET}, "
                              f"e.g. {NEW_SECRET}")
        self._key, self.source = key, source

    def mac(self, label: bytes, *parts: bytes) -> bytes:
        """HMAC-SHA256 of ``label`` + the fixed-size ``parts`` under the secret (32 bytes)."""
        return hmac.new(self._key, label + b"".join(parts), hashlib.sha256).digest()

    def derive(self, purpose: bytes) -> bytes:
        """32 bytes derived from the secret for ``purpose`` (e.g. a zmq CURVE key); one-way."""
        return self.mac(b"kvplugins/derive/" + purpose)

    def __repr__(self) -> str:
        return f"Secret(from {self.source})"


def load_secret(config: AuthConfig | None = None, warn: bool = False) -> Secret | None:
    """The configured secret, or None when none is configured. ``config`` defaults to load(AuthConfig)
    (env > config file > default); ``warn`` logs a token_file readable by others. Raises ConfigError for an
    unreadable file or a too short secret."""
    cfg = config if config is not None else load(AuthConfig)
    if cfg.token:
        return Secret(cfg.token.encode(), "auth token (KVPLUGINS_AUTH_TOKEN)")
    if not cfg.token_file:
        return None
    try:
        with open(cfg.token_file, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            key = f.read().strip()
    except OSError as e:
        raise ConfigError(f"auth token_file {cfg.token_file!r} cannot be read ({e.strerror}); "
                          f"fix KVPLUGINS_AUTH_TOKEN_FILE / --token-file, or create it: {NEW_SECRET}") from e
    if warn and mode & 0o077:
        log.warning("auth token_file %s is readable by other users (mode %o); chmod 600 it",
                    cfg.token_file, mode & 0o777)
    return Secret(key, f"auth token_file {cfg.token_file}")


def resolve(secret: Secret | None = None) -> Secret | None:
    """``secret`` if given, else the configured one (load_secret). Servers and clients call this once, at start."""
    return secret if secret is not None else load_secret()


def is_loopback(host: str) -> bool:
    """True when ``host`` (an address or a name) only reaches this machine; wildcard binds are not loopback."""
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::", "*"):
        return False
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def require_for_bind(host: str, secret: Secret | None, what: str) -> None:
    """Refuse to bind a non-loopback ``host`` without a secret. ``what`` names the setting (e.g. "master --host").
    Raises ConfigError naming the value and the fix."""
    if secret is None and not is_loopback(host):
        raise ConfigError(f"{what}={host!r} is not a loopback address and no shared secret is configured, so anyone "
                          f"who reaches it could read or overwrite the store; {HOW} (create one with: {NEW_SECRET}), "
                          "or bind 127.0.0.1")
