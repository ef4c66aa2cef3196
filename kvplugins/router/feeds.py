"""The KV event streams ``kvplugins router`` reads into its Fleet, on one thread.

* each instance's stream (``--kv-events``, one endpoint per instance): a zmq SUB connected to the engine's
  publisher (vLLM ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
  "tcp://*:PORT"}'``; SGLang's ``--kv-events-config`` alike). Its BlockStored/BlockRemoved say what the engine's
  own cache holds; with our connector its BlockStored with medium CPU the pages it saved to the pool.
* the store master's stream (``--store-master``; the master started with ``--events-port``): asked for its
  endpoints with ``info``, subscribed as role ``client`` over CURVE (store/master/events.py), its replay window
  read once at start; it says exactly what the pool holds, evictions included.

Frames are vLLM's: ``(topic, seq, payload)``, seq 8 bytes big-endian, payload a msgpack EventBatch
(store/wire/kv_events.py), decoded typed; a message of another shape is counted and dropped (logged at most every
10 s per stream), and never stops the thread. A stream whose seq goes back began again (an engine or master
restarted): that instance's cache, or the pool, is forgotten first. A master that cannot be reached is asked again
every ``RETRY_S``. Lifecycle: ``start()`` once, ``close()`` once (joins the thread, closes every socket).
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse

import msgspec
import zmq

from kvplugins.router.config import RouterConfig
from kvplugins.security import Credential, Secret
from kvplugins.router.fleet import Fleet
from kvplugins.store.wire.kv_events import EventBatch

log = logging.getLogger("kvplugins.router")
MAX_MSG = 64 << 20  # bytes: a larger event message is dropped by zmq
POLL_MS = 200
RETRY_S = 2.0
LOG_EVERY_S = 10.0
POOL = -1  # the source index of the master's stream


class Feeds:
    """Reads ``cfg``'s event streams into ``fleet``."""

    def __init__(self, cfg: RouterConfig, fleet: Fleet):
        self.cfg, self.fleet = cfg, fleet
        self.bad = 0  # messages dropped (wrong shape)
        self.batches = 0  # batches applied
        self.master_error = ""  # why the master's stream is not read ('' = read, or not asked for)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvp-router-feeds", daemon=True)
        self._decode = msgspec.msgpack.Decoder(EventBatch).decode
        self._last: dict[int, int] = {}  # source -> the last seq applied
        self._replayed: int | None = None  # the master's last seq the replay gave, until the live stream passes it
        self._logged: dict[int, float] = {}

    def wanted(self) -> bool:
        return bool(self.cfg.event_endpoints() or self.cfg.store_master)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def status(self) -> dict[str, object]:
        return {"batches": self.batches, "bad_messages": self.bad, "master_error": self.master_error}

    # -- the thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        poller = zmq.Poller()
        sources: dict[zmq.Socket[bytes], int] = {}
        try:
            for i, endpoint in enumerate(self.cfg.event_endpoints()):
                sub = _sub(ctx)
                sub.connect(endpoint)
                sources[sub] = i
                poller.register(sub, zmq.POLLIN)
            next_try = 0.0 if self.cfg.store_master else float("inf")
            while not self._stop.is_set():
                if time.monotonic() >= next_try:
                    master = self._master(ctx)
                    if master is None:
                        next_try = time.monotonic() + RETRY_S
                    else:
                        next_try = float("inf")
                        sources[master] = POOL
                        poller.register(master, zmq.POLLIN)
                for sock, _ in poller.poll(POLL_MS):
                    self._drain(sock, sources[sock])
        except Exception:  # noqa: BLE001 - the thread must not die silently; routing goes on on history alone
            log.exception("router: the KV event reader stopped")
        finally:
            for sock in sources:
                sock.close(0)
            ctx.term()

    def _drain(self, sock: zmq.Socket[bytes], source: int) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._apply(source, frames)

    def _apply(self, source: int, frames: list[bytes]) -> None:
        try:
            if len(frames) < 2 or len(frames[-2]) != 8:
                raise ValueError(f"{len(frames)} frames (want: topic, 8-byte seq, payload)")
            seq = int.from_bytes(frames[-2], "big", signed=True)
            batch = self._decode(frames[-1])
        except (ValueError, msgspec.DecodeError) as e:
            self.bad += 1
            self._warn(source, f"dropped a KV event message: {e}")
            return
        if source == POOL and self._replayed is not None:
            if seq <= self._replayed:  # the live stream repeats what the replay window gave
                return
            self._replayed = None
        elif self._last.get(source, -1) >= seq:
            self._restarted(source, seq, self._last[source])
        self._last[source] = seq
        self.batches += 1
        if source == POOL:
            self.fleet.pool_events(batch.events)
        else:
            self.fleet.engine_events(source, batch.events)

    def _restarted(self, source: int, seq: int, last: int) -> None:
        log.info("router: KV event stream %s began again (seq %d after %d)", self._name(source), seq, last)
        if source == POOL:
            self.fleet.pool_events([], fresh=True)
        else:
            self.fleet.engine_restarted(source)

    def _master(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes] | None:
        """A SUB on the master's stream with the replay window applied, or None (why in master_error)."""
        from kvplugins.errors import KVPluginsError
        from kvplugins.security import resolve
        from kvplugins.security.curve import client_socket
        from kvplugins.store.client.connect import master_client

        try:
            rpc = master_client(self.cfg.store_master, 2000)
            try:
                info = rpc.call("info")
            finally:
                rpc.close()
            if not info.get("events"):
                raise KVPluginsError(
                    f"master {self.cfg.store_master} publishes no KV events: start it with --events-port 0"
                )
            keys = resolve()
            sub = _sub(ctx)
            try:
                client_socket(sub, keys)
                sub.connect(_reachable(info["events"], self.cfg.store_master))
                self._replay(ctx, keys, _reachable(info["events_replay"], self.cfg.store_master))
            except BaseException:
                sub.close(0)  # an open socket would keep ctx.term(), and the router's exit, waiting
                raise
            self._replayed = self._last.get(POOL, -1)
        except (KVPluginsError, OSError, zmq.ZMQError) as e:
            if self.master_error != str(e):
                log.warning(
                    "router: the store master's KV events are not read (%s); asking again every %.0f s", e, RETRY_S
                )
            self.master_error = str(e)
            return None
        self.master_error = ""
        return sub

    def _replay(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: Secret | Credential | None, endpoint: str) -> None:
        """The master's buffered batches, from the first kept."""
        from kvplugins.errors import KVPluginsError
        from kvplugins.security.curve import client_socket

        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        client_socket(req, keys)
        req.connect(endpoint)
        try:
            req.send_multipart((b"", (0).to_bytes(8, "big", signed=True)))
            while True:
                if not req.poll(2000):
                    raise KVPluginsError(f"the master's event replay at {endpoint} did not answer in 2 s")
                frames = req.recv_multipart()
                if len(frames) < 4 or frames[2] == (-1).to_bytes(8, "big", signed=True):
                    return
                self._apply(POOL, frames[1:])
        finally:
            req.close(0)

    def _warn(self, source: int, msg: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(source, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[source] = now
            log.warning("router: %s: %s", self._name(source), msg)

    def _name(self, source: int) -> str:
        return "the store master" if source == POOL else self.cfg.urls()[source]


def _sub(ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    sub: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.MAXMSGSIZE, MAX_MSG)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub


def _reachable(endpoint: str, master: str) -> str:
    """``endpoint`` as the master reported it, with a wildcard host replaced by the master's."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.hostname in ("0.0.0.0", "::", "*", None):
        host = master.rsplit(":", 1)[0]
        return f"tcp://{host}:{parts.port}"
    return endpoint
