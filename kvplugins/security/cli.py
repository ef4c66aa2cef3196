"""``--token-file`` for the network commands (master, store, up, status), and handing the secret on.

The command's components (RpcServer, TransferEngine, the RPC clients) and the processes it starts (``up
--detach``) read the secret from the environment (kvplugins.security.resolve); ``apply`` resolves flag > env >
config file once and exports the result there, so a flag given here wins everywhere in that command.
"""

from __future__ import annotations

import os

from kvplugins.config import add_arguments, env_name, from_args
from kvplugins.security.secret import AuthConfig, load_secret

AUTH_COMMANDS = ("master", "store", "up", "status", "events", "credential", "p2p")


def add_flags(sub) -> None:
    """Add the AuthConfig flags (``--token-file``; the token itself only by env or file) to the network commands
    of the ``sub`` subparsers."""
    for name in AUTH_COMMANDS:
        if name in sub.choices:
            add_arguments(sub.choices[name], AuthConfig, skip=("token",))


def apply(args) -> None:
    """Resolve the secret of a network command (raises ConfigError now, not mid-start) and export it."""
    if getattr(args, "command", None) not in AUTH_COMMANDS:
        return
    cfg = from_args(AuthConfig, args)
    load_secret(cfg, warn=True)
    for name in ("token", "token_file"):
        os.environ.pop(env_name(AuthConfig, name), None)
        if getattr(cfg, name):
            os.environ[env_name(AuthConfig, name)] = getattr(cfg, name)
