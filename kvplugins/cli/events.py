"""``kvplugins events``: print the master's KV event stream (master/events.py), one JSON line per event:
``{"seq", "ts", "type", "key", "medium", "reason"}``. ``--replay-from SEQ`` first prints the buffered batches from
SEQ on (the replay window), then follows the live stream; ``--count N`` stops after N events. The endpoints come
from the master's ``info`` answer (the master needs ``--events-port``)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from kvplugins.config import add_arguments, from_args
from kvplugins.errors import ConfigError, MasterUnreachable

SHOWN = ("master", "rpc_timeout_ms")


def add_parser(sub) -> None:
    from kvplugins.store.config import ClientConfig

    p = sub.add_parser("events", help="print the store's KV events (stored, evicted, removed, offloaded)")
    add_arguments(p, ClientConfig, skip=tuple(f.name for f in dataclasses.fields(ClientConfig) if f.name not in SHOWN))
    p.add_argument("--replay-from", type=int, default=-1, help="first replay the buffered batches from this seq")
    p.add_argument("--count", type=int, default=0, help="exit after this many events (0 = run until interrupted)")
    p.add_argument("--timeout-s", type=float, default=0, help="exit after this many seconds (0 = no limit)")
    p.add_argument("--config", help="TOML/JSON config file ([client] table)")


def run(args) -> int:
    import zmq

    from kvplugins.security import resolve
    from kvplugins.security.curve import client_socket
    from kvplugins.store import embedded
    from kvplugins.store.config import ClientConfig
    from kvplugins.store.client.connect import master_client

    cfg = from_args(ClientConfig, args)
    master = embedded.resolve_master(cfg.master)
    rpc = master_client(master, cfg.rpc_timeout_ms)
    try:
        info = rpc.call("info")
    finally:
        rpc.close()
    if not info.get("events"):
        raise ConfigError(f"master {master} publishes no KV events; start it with --events-port 0 (or a port)")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    client_socket(sub, resolve())  # the event sockets are CURVE servers (master/events.py)
    sub.connect(info["events"])
    printer = _Printer(args.count)
    try:
        if args.replay_from >= 0:
            _replay(ctx, info["events_replay"], args.replay_from, printer, cfg.rpc_timeout_ms)
        deadline = time.monotonic() + args.timeout_s if args.timeout_s else None
        while not printer.done and (deadline is None or time.monotonic() < deadline):
            if sub.poll(100):
                printer.batch(*sub.recv_multipart()[1:])
    finally:
        sub.close(0)
        ctx.term()
    return 0


def _replay(ctx, endpoint: str, start: int, printer: "_Printer", timeout_ms: float) -> None:
    import zmq

    from kvplugins.security import resolve
    from kvplugins.security.curve import client_socket

    req = ctx.socket(zmq.DEALER)
    client_socket(req, resolve())
    req.connect(endpoint)
    try:
        req.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        while not printer.done:
            if not req.poll(timeout_ms):
                raise MasterUnreachable(endpoint, timeout_ms, "events replay: no answer")
            _, _topic, seq, payload = req.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) < 0:
                return
            printer.batch(seq, payload)
    finally:
        req.close(0)


class _Printer:
    def __init__(self, count: int):
        import msgspec

        from kvplugins.store.master.events import EventBatch

        self._dec = msgspec.msgpack.Decoder(EventBatch)
        self._left = count or -1
        self._last = -1

    @property
    def done(self) -> bool:
        return self._left == 0

    def batch(self, seq_bytes: bytes, payload: bytes) -> None:
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq <= self._last:  # replayed, then seen live again
            return
        self._last = seq
        b = self._dec.decode(payload)
        for ev in b.events:
            if self._left == 0:
                return
            print(
                json.dumps(
                    {
                        "seq": seq,
                        "ts": b.ts,
                        "type": type(ev).__name__,
                        "key": ev.block_hashes[0].decode(),
                        "medium": ev.medium,
                        "reason": ev.reason,
                    }
                ),
                flush=True,
            )
            self._left -= 1
        sys.stdout.flush()
