"""``kvplugins replay TRACE``: replay a request trace through the real store for capacity planning
(kvplugins/replay, docs/capacity.md)."""

from __future__ import annotations

from kvplugins.config import add_arguments, from_args


def add_parser(sub) -> None:
    from kvplugins.replay.config import ReplayConfig

    p = sub.add_parser("replay", help="replay a request trace through the store: hit ratio vs pool capacity")
    p.add_argument("trace", nargs="?", help="FAST'25 or kvplugins JSONL trace (omit with --synth)")
    add_arguments(p, ReplayConfig)
    p.add_argument("--config", help="TOML/JSON config file ([replay] table)")


def run(args) -> int:
    from kvplugins.replay.config import ReplayConfig
    from kvplugins.replay.plan import execute

    rows = execute(from_args(ReplayConfig, args), args.trace, say=lambda s: print(s, flush=True))
    return 1 if any(r["wrong_bytes"] for r in rows) else 0
