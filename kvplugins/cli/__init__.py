"""The ``kvplugins`` command. Each subcommand lives in its own module here, exposing
``add_parser(subparsers)`` and ``run(args) -> int``; this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys

from kvplugins.errors import KVPluginsError

COMMANDS = (
    "master",
    "store",
    "up",
    "status",
    "shard",
    "events",
    "demo",
    "kt",
    "mooncake",
    "doctor",
    "replay",
    "credential",
    "p2p",
    "router",
)  # module: name with "-" -> "_"


class Parser(argparse.ArgumentParser):
    """argparse with clig.dev's error style: one line naming the problem and where help is, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvplugins", description="Shared KV-cache pool for SGLang and vLLM.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for name in COMMANDS:
        importlib.import_module(f"kvplugins.cli.{name.replace('-', '_')}").add_parser(sub)
    from kvplugins.security.cli import add_flags

    add_flags(sub)  # --token-file on master, store, up, status
    for p in sub.choices.values():  # a usage line of 40 flags hides the command: --help lists them
        if len(p._actions) > 12 and p.usage is None:
            positionals = " ".join(a.metavar or a.dest for a in p._actions if not a.option_strings)
            p.usage = f"%(prog)s [options] {positionals}".rstrip()
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit status: 0 done, 2 a usage or configuration error or a refusal (one line on stderr
    naming the value and the fix), 1 an unexpected failure (one line; the traceback at --log-level DEBUG), 130
    interrupted; output into a closed pipe (``| head``) ends quietly."""
    args = build_parser().parse_args(values_may_be_negative(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from kvplugins.security.cli import apply

        apply(args)  # the shared secret: flag > env > file, handed to every component
        status = int(importlib.import_module(f"kvplugins.cli.{args.command.replace('-', '_')}").run(args) or 0)
        sys.stdout.flush()  # here, so a closed pipe is caught below, not at exit
        return status
    except KVPluginsError as e:
        print(f"kvplugins {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader left (| head): stop writing, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # noqa: BLE001 - a command never ends in a traceback; DEBUG logs it
        logging.getLogger("kvplugins").debug("kvplugins %s failed", args.command, exc_info=True)
        print(
            f"kvplugins {args.command}: error: {type(e).__name__}: {e} (a bug if the cause is not named here: "
            f"rerun with --log-level DEBUG for the traceback and report it)",
            file=sys.stderr,
        )
        return 1


def values_may_be_negative(argv: list[str]) -> list[str]:
    """``--flag -1GiB`` as ``--flag=-1GiB``: argparse takes a value that starts with "-" and is not a plain number
    for an option, answering "expected one argument" instead of the value's own error."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", token):
            out[-1] += "=" + token
        else:
            out.append(token)
    return out


if __name__ == "__main__":
    sys.exit(main())
