"""``kvplugins mooncake``: run code written for Mooncake's store on a kvplugins store.

    kvplugins mooncake enable [--force]   install the mooncake.store shim (refuses over a real Mooncake unless --force)
    kvplugins mooncake disable            remove it
    kvplugins mooncake status             shim state
"""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("mooncake", help="make `import mooncake.store` use kvplugins' store: enable/disable/status")
    msub = p.add_subparsers(dest="mooncake_command", metavar="MOONCAKE_COMMAND", required=True)
    for name, help_ in (("enable", "make `from mooncake.store import ...` use kvplugins.store.compat"),
                        ("disable", "remove the mooncake shim"), ("status", "show the shim state")):
        c = msub.add_parser(name, help=help_)
        c.add_argument("--site-dir", help="site-packages to install into (default: this interpreter's)")
        if name == "enable":
            c.add_argument("--force", action="store_true", help="shadow a real Mooncake installation")


def run(args) -> int:
    from kvplugins.store import mooncake_shim as shim
    if args.mooncake_command == "enable":
        st = shim.enable(args.site_dir, force=args.force)
    elif args.mooncake_command == "disable":
        st = shim.disable(args.site_dir)
    else:
        st = shim.status(args.site_dir)
    print(st.describe())
    if st.enabled:
        print("point the Mooncake config's master_server_address at a kvplugins master (host:port, etcd://..., "
              "shards://...); metadata_server is not used")
    return 0
