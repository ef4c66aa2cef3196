"""The cluster's shared secret, the role credentials derived from it, and the per-user default.

Authentication is always on, loopback included (issue #30). Where the secret comes from, highest first:
``--token-file`` / env ``KVPLUGINS_AUTH_TOKEN_FILE`` / ``KVPLUGINS_AUTH_TOKEN`` / the ``[auth]`` table of the
config file (kvplugins.config.load: flag > env > file); with none configured, the per-user default
``$XDG_CONFIG_HOME/kvplugins/secret`` (else ``~/.config/kvplugins/secret``), created 0600 in a 0700 folder by the
first kvplugins process of that user that needs it. So every master, node, client, adapter and CLI of one user
on one host agrees with no configuration, and another user's processes (who cannot read the file) are refused.

Roles (security/roles.py): ``client`` < ``node`` < ``admin``, plus ``data`` (transfer peers). The cluster secret
gives every role; a *role credential* (``kvplugins credential --role client --name engine-a``: a JSON file holding
the key of that role and name, derived one-way from the secret by HMAC-SHA256, and the data-plane key) gives
only its role, under its name: the master bounds what each named identity may hold (master/quotas.py), and
nothing in a credential yields the secret, another role's key or another name's. The secret itself never goes on the wire: connections prove a role's
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
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvplugins.config import component, load
from kvplugins.errors import ConfigError
from kvplugins.security.roles import MASTER_ROLES

log = logging.getLogger("kvplugins.security")
MIN_SECRET = 16
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a credential's name: the identity the master bounds
NEW_SECRET = (
    "python -c 'import secrets; print(secrets.token_hex(32))' > /etc/kvplugins/token && chmod 600 /etc/kvplugins/token"
)
HOW = (
    "give every master, node and client of the cluster the same secret: KVPLUGINS_AUTH_TOKEN_FILE=<file> "
    "(or --token-file, or token_file in the [auth] table of the config file)"
)


@component("auth")
@dataclass(frozen=True)
class AuthConfig:
    """The shared secret or a role credential (env KVPLUGINS_AUTH_TOKEN / KVPLUGINS_AUTH_TOKEN_FILE). Empty = the
    per-user default secret (default_secret_path()), which is enough while every endpoint binds a loopback
    address; a cluster across hosts configures one secret on all of them."""

    token: str = field(
        default="",
        metadata={
            "help": "the shared secret itself (prefer token_file: a value in the environment or on a command line "
            "is visible to other processes of the same user)"
        },
    )
    token_file: str = field(
        default="",
        metadata={
            "help": "file holding the shared secret or a role credential (kvplugins credential; keep it mode 0600)"
        },
    )

    def __post_init__(self) -> None:
        if self.token and self.token_file:
            raise ConfigError("auth: both token and token_file are set; give only one (token_file is preferred)")


class Secret:
    """The cluster's shared secret (at least MIN_SECRET bytes): it gives every role. Its value is never printed;
    ``source`` says where it came from, ``auto`` whether it is the per-user default (one host only)."""

    __slots__ = ("_key", "source", "auto")
    role = "admin"
    name = ""  # a secret holder is the cluster itself: no per-identity bounds apply to it

    def __init__(self, key: bytes, source: str, auto: bool = False):
        if len(key) < MIN_SECRET:
            raise ConfigError(
                f"the shared secret from {source} has {len(key)} bytes; use at least {MIN_SECRET}, e.g. {NEW_SECRET}"
            )
        self._key, self.source, self.auto = key, source, auto

    def key(self, role: str) -> bytes:
        """The 32-byte key of ``role`` ("data", "client", "node" or "admin"), derived one-way."""
        return self.derive(b"role/" + role.encode())

    def identity_key(self, role: str, name: str) -> bytes:
        """The key of the credential named ``name`` of ``role`` (the role's key when ``name`` is "")."""
        return named_key(self.key(role), name) if name else self.key(role)

    def curve_secret(self, role: str) -> bytes:
        """The z85 CURVE secret key this secret holder uses on the master's control plane as ``role``."""
        return derive_curve(self.key(role), b"kvplugins/zmq-curve-client")

    def mac(self, label: bytes, *parts: bytes) -> bytes:
        """HMAC-SHA256 of ``label`` + the fixed-size ``parts`` under the secret (32 bytes)."""
        return hmac.new(self._key, label + b"".join(parts), hashlib.sha256).digest()

    def derive(self, purpose: bytes) -> bytes:
        """32 bytes derived from the secret for ``purpose`` (e.g. a zmq CURVE key); one-way."""
        return self.mac(b"kvplugins/derive/" + purpose)

    def __repr__(self) -> str:
        return f"Secret(from {self.source})"


class Credential:
    """A role credential: the key of one role under one name (plus the data-plane key every role has), the
    CURVE key its role's credentials share on the control plane and the master's public CURVE key. It gives
    ``role`` and the roles below it only where a server derives them from this key, as the identity
    ``role:name``; it cannot be turned into the secret, a higher role's key or another name's. Parsed from the
    JSON ``issue_credential`` wrote."""

    __slots__ = ("role", "name", "_key", "_data", "_curve", "curve_server", "source")
    auto = False

    def __init__(self, role: str, name: str, key: bytes, data: bytes, curve: bytes, curve_server: bytes, source: str):
        if (
            role not in MASTER_ROLES
            or not NAME.fullmatch(name)
            or len(key) != 32
            or len(data) != 32
            or len(curve) != 40
        ):
            raise ConfigError(
                f"the role credential from {source} is malformed (role {role!r}, name {name!r}); "
                "issue a new one with: kvplugins credential --role client|node|admin --name NAME "
                "--out FILE"
            )
        self.role, self.name, self._key, self._data = role, name, key, data
        self._curve, self.curve_server, self.source = curve, curve_server, source

    def key(self, role: str) -> bytes | None:
        """The key of ``role`` if this credential holds it (its own role's, under its name, and "data"), else
        None."""
        return self._key if role == self.role else self._data if role == "data" else None

    def curve_secret(self, role: str) -> bytes | None:
        """The z85 CURVE secret key of ``role``'s credentials (None for another role)."""
        return self._curve if role == self.role else None

    @classmethod
    def parse(cls, text: bytes, source: str) -> "Credential":
        try:
            d = json.loads(text)
            return cls(
                d["role"],
                d["name"],
                bytes.fromhex(d["key"]),
                bytes.fromhex(d["data_key"]),
                d["curve_key"].encode(),
                d["master_curve_key"].encode(),
                source,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(
                f"{source} is neither a shared secret nor a role credential ({e}); issue one with: "
                "kvplugins credential --role client|node|admin --name NAME --out FILE"
            ) from e

    def __repr__(self) -> str:
        return f"Credential({self.role}:{self.name}, from {self.source})"


def named_key(role_key: bytes, name: str) -> bytes:
    """The key of the credential ``name`` of the role whose key is ``role_key``; one-way."""
    return hmac.new(role_key, b"kvplugins/identity/" + name.encode(), hashlib.sha256).digest()


def derive_curve(role_key: bytes, label: bytes) -> bytes:
    """A z85 CURVE secret key derived one-way from ``role_key`` for ``label``."""
    from zmq.utils import z85

    return z85.encode(hmac.new(role_key, label, hashlib.sha256).digest())


def credential_curve_secret(secret: Secret, role: str) -> bytes:
    """The z85 CURVE secret key every ``role`` credential uses on the control plane (not the secret holders')."""
    return derive_curve(secret.key(role), b"kvplugins/zmq-curve-credential")


def owner_proof(keys: "Secret | Credential | None", owner: str) -> dict:
    """register_segment options naming a role credential's identity on the control plane, proved over the
    process's random segment owner token ``owner`` ({} for a secret holder: it is not bounded)."""
    if not isinstance(keys, Credential):
        return {}
    return {"name": keys.name, "proof": _owner_mac(keys.key(keys.role), owner)}


def proved_identity(secret: Secret, role: str, name: str, owner: str, proof: bytes) -> str | None:
    """``role:name`` when ``proof`` (owner_proof) proves the credential ``name`` of ``role`` over ``owner``,
    else None."""
    if not NAME.fullmatch(name) or len(proof) != 32:
        return None
    good = hmac.compare_digest(proof, _owner_mac(secret.identity_key(role, name), owner))
    return f"{role}:{name}" if good else None


def _owner_mac(key: bytes, owner: str) -> bytes:
    return hmac.new(key, b"kvplugins/segment-owner/" + owner.encode(), hashlib.sha256).digest()


def issue_credential(secret: Secret, role: str, name: str, curve_server: bytes) -> str:
    """The JSON text of the ``role`` credential named ``name`` (the identity ``role:name`` the master bounds),
    derived from ``secret`` (curve_server: the master's public z85 CURVE key, security/curve.py server_keys).
    Raises ConfigError for an unknown role or a name outside [A-Za-z0-9._-]{1,64}."""
    if role not in MASTER_ROLES:
        raise ConfigError(f"role {role!r} is not one of client, node, admin")
    if not NAME.fullmatch(name):
        raise ConfigError(f"credential name {name!r} must be 1-64 of A-Z a-z 0-9 . _ - (e.g. engine-a)")
    return (
        json.dumps(
            {
                "kvplugins_credential": 2,
                "role": role,
                "name": name,
                "key": secret.identity_key(role, name).hex(),
                "data_key": secret.key("data").hex(),
                "curve_key": credential_curve_secret(secret, role).decode(),
                "master_curve_key": curve_server.decode(),
            }
        )
        + "\n"
    )


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
            os.link(tmp, path)  # atomic and never replaces: concurrent first processes agree
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
            raise ConfigError(
                f"the per-user shared secret {path} is owned by uid {st.st_uid} with mode "
                f"{st.st_mode & 0o777:o}; it must be this user's (uid {os.getuid()}) and mode 0600: "
                f"chmod 600 {path} (or remove it; the next kvplugins process makes a new one)"
            )
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
        raise ConfigError(
            f"auth token_file {cfg.token_file!r} cannot be read ({e.strerror}); "
            f"fix KVPLUGINS_AUTH_TOKEN_FILE / --token-file, or create it: {NEW_SECRET}"
        ) from e
    if warn and mode & 0o077:
        log.warning(
            "auth token_file %s is readable by other users (mode %o); chmod 600 it", cfg.token_file, mode & 0o777
        )
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
        raise ConfigError(
            f"{what} has no shared secret: none is configured and the per-user default "
            f"{default_secret_path()} cannot be created; {HOW}"
        )
    return keys


def resolve_server(what: str) -> Secret:
    """The cluster secret a master (or disk server) authenticates its peers with: the configured one, else the
    per-user default. Raises ConfigError naming ``what`` and the fix when there is none, or only a role
    credential (a server derives every role's key, so it needs the secret itself)."""
    secret = require(what)
    if isinstance(secret, Secret):
        return secret
    raise ConfigError(
        f"{what} needs the cluster's shared secret, but {secret.source} is a {secret.role} role credential; {HOW}"
    )


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
        raise ConfigError(
            f"{what}={host!r} is not a loopback address and no shared secret is configured, so anyone "
            f"who reaches it could read or overwrite the store; {HOW} (create one with: {NEW_SECRET}), "
            "or bind 127.0.0.1"
        )
