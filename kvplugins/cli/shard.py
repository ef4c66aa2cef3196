"""``kvplugins shard``: the membership of a sharded store (kvplugins/store/cluster, master/shard.py). A master
joins by starting (``kvplugins master --cluster shards://... --shard ID``); ``remove ID`` takes one out (its keys move to the
others, read from it while the move window runs; stop it after ``kvplugins status`` shows the move done);
``list`` prints the membership as JSON."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    from kvplugins.store.config import MasterConfig

    p = sub.add_parser("shard", help="list or remove the shards (masters) of a sharded store")
    p.add_argument("action", choices=("list", "remove"))
    p.add_argument("shard", nargs="?", default="", help="with remove: the shard id")
    p.add_argument("--master", required=True, help="the sharded store, shards://host:port/prefix")
    p.add_argument(
        "--window-ms",
        type=int,
        default=MasterConfig.shard_move_window_ms,
        help="after the removal, its keys are still read from it this long",
    )
    p.add_argument("--force", action="store_true", help="remove even while another move is unswept (a member is dead)")


def run(args) -> int:
    from kvplugins.errors import ConfigError
    from kvplugins.store.cluster.membership import Membership

    members = Membership(args.master)
    if args.action == "list":
        st = members.read()
        print(
            json.dumps(
                {
                    "epoch": st.epoch,
                    "members": st.members,
                    "previous": st.previous,
                    "joining": {sid: j.address for sid, j in st.joining.items()},
                    "moving": st.moving(),
                    "swept": st.swept,
                },
                indent=1,
            )
        )
        return 0
    if not args.shard:
        raise ConfigError("kvplugins shard remove needs the shard id, e.g. `kvplugins shard remove d --master ...`")
    if args.window_ms < 0:
        raise ConfigError(f"--window-ms {args.window_ms} must be >= 0")
    st = members.remove(args.shard, args.window_ms, args.force)
    print(
        f"shard {args.shard} removed: epoch {st.epoch}, shards {', '.join(sorted(st.members)) or 'none'}; its "
        f"keys are read from it for {args.window_ms} ms more"
    )
    return 0
