"""The cluster's shared secret, the role credentials derived from it, and the per-user default.

Authentication is always on, loopback included (issue #30). Where the secret comes from, highest first:
``--token-file`` / env ``KVPLUGINS_AUTH_TOKEN_FILE`` / ``KVPLUGINS_AUTH_TOKEN`` / the ``[auth]`` table of the
config file (kvplugins.config.load: flag > env > file); with none configured, the per-user default
``$XDG_CONFIG_HOME/kvplugins/secret`` (else ``~/.config/kvplugins/secret``), created 0600 in a 0700 folder by the
first kvplugins process of that user that needs it. So every master, node, client, adapter and CLI of one user
on one host agrees with no configuration, and another user's processes (who cannot read the file) are refused.

Roles (security/roles.py): ``client`` < ``node`` < ``admin``, plus ``data`` (transfer peers). The cluster secret
gives every role; a *role credential* (``kvplugins credential --role client``: a JSON file holding that role's
key, derived one-way from the secret by HMAC-SHA256, and the data-plane key) gives only its role, and nothing in
it yields the secret or another role's key. The secret itself never goes on the wire: connections prove a role's
key with HMAC-SHA256 challenges (handshake.py) and the zmq control plane uses CURVE keys derived from them
(curve.py).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

from kvplugins.config import component, load
from kvplugins.errors import ConfigError
from kvplugins.security.roles import MASTER_ROLES

log = logging.getLogger("kvplugins.security")
MIN_SECRET = 16
NEW_SECRET = ("python -c 'import secrets; print(secrets.token_hex(32))' > /etc/kvplugins/token && "
              "chmod 600 /etc/kvplugins/token")
HOW = ("give every master, node and client of the cluster the same secret: KVPLUGINS_AUTH_TOKEN_FILE=<file> "
       "(or --token-file, or token_file in the [auth] table of the config file)")


@component("auth")
@dataclass(frozen=True)
class AuthConfig:
    """The shared secret or a role credential (env KVPLUGINS_AUTH_TOKEN / KVPLUGINS_AUTH_TOKEN_FILE). Empty = the
    per-user default secret (default_secret_path()), which is enough while every endpoint binds a loopback
    address; a cluster across hosts configures one secret on all of them."""
    token: str = field(default="", metadata={
        "help": "the shared secret itself (prefer token_file: a value in the environment or on a command line "
                "is visible to other processes of the same user)"})
    token_file: str = field(default="", metadata={
        "help": "file holding the shared secret or a role credential (kvplugins credential; keep it mode 0600)"})

    def __post_init__(self) -> None:
        if self.token and self.token_file:
            raise ConfigError("auth: both token and token_file are set; give only one (token_file is preferred)")


class Secret:
    """The cluster's shared secret (at least MIN_SECRET bytes): it gives every role. Its value is never printed;
    ``source`` says where it came from, ``auto`` whether it is the per-user default (one host only)."""
    __slots__ = ("_key", "source", "auto")
    role = "admin"

    def __init__(self, key: bytes, source: str, auto: bool = False):
        if len(key) < MIN_SECRET:
            raise ConfigError(f"the shared secret from {source} has {len(key)} bytes; use at least {MIN_SECRET}, "
                              f"e.g. {NEW_SECRET}")
        self._key, self.source, self.auto = key, source, auto

    def key(self, role: str) -> bytes:
        """The 32-byte key of ``role`` ("data", "client", "node" or "admin"), derived one-way."""
        return self.derive(b"role/" + role.encode())

    def mac(self, label: bytes, *parts: bytes) -> bytes:
        """HMAC-SHA256 of ``label`` + the fixed-size ``parts`` under the secret (32 bytes)."""
        return hmac.new(self._key, label + b"".join(parts), hashlib.sha256).digest()

    def derive(self, purpose: bytes) -> bytes:
        """32 bytes derived from the secret for ``purpose`` (e.g. a zmq CURVE key); one-way."""
        return self.mac(b"kvplugins/derive/" + purpose)

    def __repr__(self) -> str:
        return f"Secret(from {self.source})"


class Credential:
    """A role credential: the key of one role (plus the data-plane key every role has) and the master's public
    CURVE key. It gives ``role`` and the roles below it only where a server derives them from this key; it
    cannot be turned into the secret or a higher role's key. Parsed from the JSON ``issue_credential`` wrote."""
    __slots__ = ("role", "_key", "_data", "curve_server", "source")
    auto = False

    def __init__(self, role: str, key: bytes, data: bytes, curve_server: bytes, source: str):
        if role not in MASTER_ROLES or len(key) != 32 or len(data) != 32:
            raise ConfigError(f"the role credential from {source} is malformed (role {role!r}); issue a new one "
                              "with: kvplugins credential --role client|node|admin --out FILE")
        self.role, self._key, self._data, self.curve_server, self.source = role, key, data, curve_server, source

    def key(self, role: str) -> bytes | None:
        """The key of ``role`` if this credential holds it (its own role, and "data"), else None."""
        return self._key if role == self.role else self._data if role == "data" else None

    @classmethod
    def parse(cls, text: bytes, source: str) -> "Credential":
        try:
            d = json.loads(text)
            return cls(d["role"], bytes.fromhex(d["key"]), bytes.fromhex(d["data_key"]),
                       d["master_curve_key"].encode(), source)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{source} is neither a shared secret nor a role credential ({e}); issue one with: "
                              "kvplugins credential --role client|node|admin --out FILE") from e

    def __repr__(self) -> str:
        return f"Credential({self.role}, from {self.source})"


def issue_credential(secret: Secret, role: str, curve_server: bytes) -> str:
    """The JSON text of a ``role`` credential derived from ``secret`` (curve_server: the master's public z85
    CURVE key, security/curve.py server_keys). Raises ConfigError for an unknown role."""
    if role not in MASTER_ROLES:
        raise ConfigError(f"role {role!r} is not one of client, node, admin")
    return json.dumps({"kvplugins_credential": 1, "role": role, "key": secret.key(role).hex(),
                       "data_key": secret.key("data").hex(), "master_curve_key": curve_server.decode()}) + "\n"


def default_secret_path() -> Path | None:
    """Where the per-user default secret lives: $XDG_CONFIG_HOME/kvplugins/secret, else
    ~/.config/kvplugins/secret; None when this process has no home folder."""
    base = os.environ.get("XDG_CONFIG_HOME")
    if not base:
        try:
            base = str(Path.home() / ".config")
        except (RuntimeError, KeyError):
            return None
    return Path(base) / "kvplugins" / "secret"


def default_secret() -> Secret | None:
    """The per-user default secret, created (32 random bytes, hex, mode 0600, folder 0700) by the first process
    that asks; None when it cannot be read or created (no home, read-only home). Raises ConfigError for a file
    that another user owns or could read (fix named)."""
    path = default_secret_path()
    if path is None:
        return None
    try:
        return _read_default(path)
    except FileNotFoundError:
        pass
    except PermissionError:
        return None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".secret.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        try:
            os.link(tmp, path)            # atomic and never replaces: concurrent first processes agree
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        log.info("created the per-user shared secret %s (mode 0600)", path)
        return _read_default(path)
    except OSError as e:
        log.debug("no per-user shared secret at %s: %s", path, e)
        return None


def _read_default(path: Path) -> Secret:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(f"the per-user shared secret {path} is owned by uid {st.st_uid} with mode "
                              f"{st.st_mode & 0o777:o}; it must be this user's (uid {os.getuid()}) and mode 0600: "
                              f"chmod 600 {path} (or remove it; the next kvplugins process makes a new one)")
        return Secret(f.read().strip(), f"the per-user secret {path}", auto=True)


def load_secret(config: AuthConfig | None = None, warn: bool = False) -> Secret | Credential | None:
    """The configured secret or role credential, else the per-user default (default_secret); None only when
    none is configured and the default cannot be had. ``config`` defaults to load(AuthConfig) (env > config
    file > default); ``warn`` logs a token_file readable by others. Raises ConfigError for an unreadable file, a
    too short secret or a malformed credential."""
    cfg = config if config is not None else load(AuthConfig)
    if cfg.token:
        return Secret(cfg.token.encode(), "auth token (KVPLUGINS_AUTH_TOKEN)")
    if not cfg.token_file:
        return default_secret()
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
    source = f"auth token_file {cfg.token_file}"
    return Credential.parse(key, source) if key.startswith(b"{") else Secret(key, source)


def resolve(secret: Secret | Credential | None = None) -> Secret | Credential | None:
    """``secret`` if given, else load_secret(). Clients call this once, at start; None: this process has no
    credential at all, and every server will refuse it."""
    return secret if secret is not None else load_secret()


def require(what: str) -> Secret | Credential:
    """This process's credential (load_secret) for ``what`` (e.g. "the transfer server"), which must
    authenticate its peers. Raises ConfigError naming the fix when there is none."""
    keys = load_secret()
    if keys is None:
        raise ConfigError(f"{what} has no shared secret: none is configured and the per-user default "
                          f"{default_secret_path()} cannot be created; {HOW}")
    return keys


def resolve_server(what: str) -> Secret:
    """The cluster secret a master (or disk server) authenticates its peers with: the configured one, else the
    per-user default. Raises ConfigError naming ``what`` and the fix when there is none, or only a role
    credential (a server derives every role's key, so it needs the secret itself)."""
    secret = require(what)
    if isinstance(secret, Secret):
        return secret
    raise ConfigError(f"{what} needs the cluster's shared secret, but {secret.source} is a {secret.role} role "
                      f"credential; {HOW}")


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


def require_for_bind(host: str, secret: Secret | Credential | None, what: str) -> None:
    """Refuse to bind a non-loopback ``host`` without a configured secret (the per-user default reaches no other
    host). ``what`` names the setting (e.g. "master --host"). Raises ConfigError naming the value and the fix."""
    if (secret is None or secret.auto) and not is_loopback(host):
        raise ConfigError(f"{what}={host!r} is not a loopback address and no shared secret is configured, so anyone "
                          f"who reaches it could read or overwrite the store; {HOW} (create one with: {NEW_SECRET}), "
                          "or bind 127.0.0.1")
