"""The ``kvplugins`` command. Each subcommand lives in its own module here, exposing
``add_parser(subparsers)`` and ``run(args) -> int``; this file only dispatches."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvplugins.errors import KVPluginsError

COMMANDS = ("master", "store", "up", "status", "shard", "events", "demo", "kt", "mooncake", "pd-proxy", "doctor",
            "replay", "credential")  # module: name with "-" -> "_"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplugins", description="Shared KV-cache pool for SGLang and vLLM.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"kvplugins.cli.{name.replace('-', '_')}").add_parser(sub)
    from kvplugins.security.cli import add_flags
    add_flags(sub)                               # --token-file on master, store, up, status
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from kvplugins.security.cli import apply
        apply(args)                              # the shared secret: flag > env > file, handed to every component
        return int(importlib.import_module(f"kvplugins.cli.{args.command.replace('-', '_')}").run(args) or 0)
    except KVPluginsError as e:
        print(f"kvplugins {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
