"""Security of the store's connections: the shared secret, the loopback-only default, and authentication.

* secret.py     AuthConfig (``[auth]``, env KVPLUGINS_AUTH_TOKEN / KVPLUGINS_AUTH_TOKEN_FILE), Secret, Credential,
                the per-user default secret, resolve() / resolve_server(), require_for_bind(): a non-loopback bind
                without a configured secret raises ConfigError.
* roles.py      client < node < admin (and data): which ops each role may run on the master.
* handshake.py  mutual HMAC challenge-response once per TCP connection (master raw RPC, transfer TCP).
* curve.py      the master's zmq control plane under CURVE keys derived from the secret (imports zmq: lazy).
* refusals.py   the rate-limited log line naming each refused peer.
* cli.py        ``--token-file`` for the network commands.
Shared memory (same host) is protected by file permissions: segments are 0600 memfd / /dev/shm files.
Nothing here pickles; no wire of kvplugins carries pickle (tests/store/test_no_pickle.py).
"""

from kvplugins.security.handshake import MAGIC, ServerHandshake, check_refused
from kvplugins.security.refusals import RefusalLog
from kvplugins.security.secret import (
    AuthConfig,
    Credential,
    Secret,
    is_loopback,
    load_secret,
    require_for_bind,
    require,
    resolve,
    resolve_server,
)

__all__ = [
    "AuthConfig",
    "Credential",
    "MAGIC",
    "RefusalLog",
    "Secret",
    "ServerHandshake",
    "check_refused",
    "is_loopback",
    "load_secret",
    "require",
    "require_for_bind",
    "resolve",
    "resolve_server",
]
