"""``kvplugins p2p``: share a checkpoint directory peer to peer (kvplugins/p2p; docs/p2p.md).

``publish DIR --name N`` registers the directory's files and serves them until interrupted; ``fetch N DIR``
pulls them from every peer that holds them (a progress bar on a terminal), writes them, and with ``--serve``
keeps serving them until interrupted; ``list [PREFIX]`` prints the catalog. Every command takes the catalog's
``--etcd`` and the P2PConfig flags; on another host, ``--host`` is this peer's address and the cluster secret
must be configured (kvplugins.security)."""

from __future__ import annotations

import json
import threading
import time

from kvplugins.config import format_bytes


def add_parser(sub) -> None:
    from kvplugins.config import add_arguments
    from kvplugins.p2p.config import P2PConfig

    p = sub.add_parser("p2p", help="share a checkpoint directory peer to peer (publish, fetch, list)")
    p.add_argument("action", nargs="?", choices=("publish", "fetch", "list"))
    p.add_argument("args", nargs="*", help="publish: DIR; fetch: NAME DIR; list: [PREFIX]")
    p.add_argument("--name", default="", help="publish: the object's name (default: the directory's name)")
    p.add_argument("--force", action="store_true", help="publish: replace an object of that name")
    p.add_argument("--serve", action="store_true", help="fetch: keep serving the files until interrupted")
    p.add_argument("--json", action="store_true", help="list: JSON lines, not a table")
    p.add_argument("--config", default=None, help="config file (TOML/JSON) with a [p2p] table")
    add_arguments(p, P2PConfig, common=("etcd", "host"))


def run(args) -> int:
    from kvplugins.config import from_args
    from kvplugins.errors import ConfigError
    from kvplugins.p2p.config import P2PConfig
    from kvplugins.p2p.store import P2PStore

    cfg = from_args(P2PConfig, args)  # its errors first: they name the flag
    if args.action is None:
        raise ConfigError("kvplugins p2p needs an action: publish DIR, fetch NAME DIR or list [PREFIX]")
    want = {"publish": (1, 1), "fetch": (2, 2), "list": (0, 1)}[args.action]
    if not want[0] <= len(args.args) <= want[1]:
        usage = {"publish": "DIR --name NAME", "fetch": "NAME DIR", "list": "[PREFIX]"}[args.action]
        raise ConfigError(f"kvplugins p2p {args.action} takes {usage}, got {args.args!r}")
    with P2PStore(cfg) as store:
        return {"publish": _publish, "fetch": _fetch, "list": _list}[args.action](store, args)


def _publish(store, args) -> int:
    from pathlib import Path

    from kvplugins.p2p.checkpoint import publish

    directory = args.args[0]
    name = args.name or Path(directory).resolve().name
    p = publish(store, name, directory, force=args.force)
    print(
        f"published {name}: {len(p.sizes)} files, {format_bytes(p.size)} in {len(p.chunks)} chunks; serving "
        "until interrupted",
        flush=True,
    )
    _serve_until_signal()
    store.unregister(name)
    return 0


def _fetch(store, args) -> int:
    from kvplugins.p2p.checkpoint import fetch

    name, directory = args.args
    with _Bar(name) as bar:
        st = fetch(store, name, directory, bar.update)
    rate = st.bytes / max(st.seconds, 1e-9) / 1e6
    print(
        f"fetched {name} into {directory}: {format_bytes(st.bytes)} in {st.seconds:.2f} s ({rate:.0f} MB/s) from "
        f"{len(st.from_peers)} peers; {st.failed} reads failed, {st.mismatched} mismatched, each read again",
        flush=True,
    )
    if args.serve:
        print(f"serving {name} until interrupted", flush=True)
        _serve_until_signal()
    store.delete_replica(name)
    return 0


def _list(store, args) -> int:
    rows = store.list(args.args[0] if args.args else "")
    if args.json:
        for r in rows:
            print(json.dumps({**r.__dict__, "sizes": list(r.sizes), "labels": list(r.labels)}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "size", "files", "chunks", "holders", "complete", "owner")
    for r in rows:
        table.add_row(
            r.name, format_bytes(r.size), str(len(r.sizes)), str(r.chunks), str(r.holders), str(r.complete), r.owner
        )
    Console().print(table)
    return 0


def _serve_until_signal() -> None:
    from kvplugins.store.process import stop_on_signals

    stop = threading.Event()
    stop_on_signals(stop.set)
    while not stop.wait(1.0):
        pass


class _Bar:
    """A rich progress bar on a terminal's stderr; nothing otherwise."""

    def __init__(self, name: str):
        self.name, self._progress, self._task, self._t0 = name, None, None, time.monotonic()

    def __enter__(self) -> "_Bar":
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        console = Console(stderr=True)
        if console.is_terminal:
            self._progress = Progress(
                "[bold]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=console
            )
            self._progress.start()
        return self

    def update(self, done: int, total: int) -> None:
        if self._progress is not None:
            if self._task is None:
                self._task = self._progress.add_task(self.name, total=total)
            self._progress.update(self._task, completed=done)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
