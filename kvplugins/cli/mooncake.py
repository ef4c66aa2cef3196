"""``kvplugins mooncake``: run code written for Mooncake's store and Transfer Engine on kvplugins.

kvplugins mooncake enable [--force]   install the mooncake.store + mooncake.engine shim (refuses over a real
                                      Mooncake unless --force)
kvplugins mooncake disable            remove it
kvplugins mooncake status             shim state
"""

from __future__ import annotations


def add_parser(sub) -> None:
    from kvplugins.shims import add_commands

    p = sub.add_parser(
        "mooncake", help="make `import mooncake.store` / `mooncake.engine` use kvplugins: enable/disable/status"
    )
    add_commands(
        p.add_subparsers(dest="mooncake_command", metavar="MOONCAKE_COMMAND", required=True),
        "mooncake",
        "`from mooncake.store import ...` and `from mooncake.engine import ...`",
    )


def run(args) -> int:
    from kvplugins.shims import run_command
    from kvplugins.mooncake.shim import SHIM

    st = run_command(SHIM, args.mooncake_command, args)
    print(st.describe())
    if st.enabled:
        print(
            "point the Mooncake config's master_server_address at a kvplugins master (host:port, etcd://..., "
            "shards://...); metadata_server is not used"
        )
    return 0
