"""``kvplugins credential --role client|node|admin [--name NAME] --out FILE``: issue a role credential
(security/roles.py).

The file (mode 0600) holds the key of that role under that name, derived one-way from this process's cluster
secret (``--token-file`` / env / the per-user default), the data-plane key and the master's public CURVE key:
hand it to a process that should have that role and no more (an engine container: client; a store node: node)
as its ``KVPLUGINS_AUTH_TOKEN_FILE``. Nothing in it yields the secret, a higher role's key or another name's.
The master bounds each name's share (pending puts and bytes, segments, connections: master/quotas.py), so give
each engine or node its own name; without ``--name`` a random one is chosen and printed.
"""

from __future__ import annotations

import os
import secrets


def add_parser(sub) -> None:
    p = sub.add_parser("credential", help="issue a client, node or admin credential derived from the secret")
    from kvplugins.security.roles import MASTER_ROLES

    p.add_argument("--role", required=True, choices=MASTER_ROLES, help="the role it gives")
    p.add_argument(
        "--name",
        default="",
        help="the identity the master bounds (1-64 of A-Z a-z 0-9 . _ -); default: <role>-<8 random hex digits>",
    )
    p.add_argument("--out", required=True, help="file to write (created mode 0600; an existing file is kept)")


def run(args) -> int:
    from kvplugins.errors import ConfigError
    from kvplugins.security import resolve_server
    from kvplugins.security.curve import server_keys
    from kvplugins.security.secret import issue_credential

    secret = resolve_server("kvplugins credential")
    name = args.name or f"{args.role}-{secrets.token_hex(4)}"
    text = issue_credential(secret, args.role, name, server_keys(secret)[0])
    try:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError as e:
        raise ConfigError(f"--out {args.out!r} exists; remove it or name another file") from e
    except OSError as e:
        raise ConfigError(f"--out {args.out!r} cannot be created ({e.strerror}); name a writable path") from e
    with os.fdopen(fd, "w") as f:
        f.write(text)
    print(
        f"wrote the {args.role} credential {args.role}:{name} to {args.out} (from {secret.source}); give it to the "
        f"process as KVPLUGINS_AUTH_TOKEN_FILE={args.out}"
    )
    return 0
