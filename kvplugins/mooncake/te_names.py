"""Mooncake Transfer Engine segment names in etcd (its etcd metadata mode: ``initialize(name,
"etcd://host:port", ...)`` or a bare ``host:port``): a segment is named freely (``prefill-0``), and peers find its
handshake server by name. Keys: ``{prefix}/mooncake-te/{quoted name}`` = ``{"host", "port"}`` (JSON) under the
publishing process's etcd lease (``ttl_s``), created only where the name is free: a live process keeps its name,
a dead one's name frees when its lease ends. What a peer then asks the server named is what P2PHANDSHAKE asks
(te_peers.py). Mooncake keeps a segment's whole descriptor and RPC address under ``mooncake/ram/`` and
``mooncake/rpc_meta/`` with no lease (a dead peer's entry stays); ours is not wire-compatible with its keys.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.parse

from kvplugins.errors import StoreError, TransferFailed
from kvplugins.store.cluster.etcd import Etcd, parse_endpoint

log = logging.getLogger("kvplugins.mooncake.te")
TTL_S = 10


class EtcdNames:
    """Names published in and looked up from the etcd at ``url`` (etcd://host:port[,host:port][/prefix]).
    Raises ConfigError (a bad url) at construction; thread-safe."""

    def __init__(self, url: str, ttl_s: int = TTL_S):
        _, prefix = parse_endpoint(url)
        self.url, self._ttl_s = url, ttl_s
        self._base = (prefix or "/kvplugins") + "/mooncake-te/"
        self._local = threading.local()
        self._lease = 0
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    @property
    def _etcd(self) -> Etcd:
        e = getattr(self._local, "etcd", None)
        if e is None:
            e = self._local.etcd = Etcd(self.url)
        return e

    def _key(self, name: str) -> str:
        return self._base + urllib.parse.quote(name, safe="")

    def publish(self, name: str, host: str, port: int) -> None:
        """Claim ``name`` for the server at ``host``:``port`` while this process lives. Raises TransferFailed when
        a live process holds the name, StoreError when etcd does not answer."""
        self._lease = self._etcd.lease(self._ttl_s)
        if not self._etcd.create(self._key(name), json.dumps({"host": host, "port": port}).encode(), self._lease):
            self._etcd.revoke(self._lease)
            raise TransferFailed(
                f"segment name {name!r} is held by another live process (etcd {self.url}); pick another"
            )
        self._keeper = threading.Thread(target=self._keep, name="mooncake-te-lease", daemon=True)
        self._keeper.start()

    def lookup(self, name: str) -> tuple[str, int]:
        """(host, port) of the server named ``name``. Raises TransferFailed (no such live segment, a malformed
        entry) or StoreError (etcd)."""
        raw = self._etcd.get(self._key(name))
        if raw is None:
            raise TransferFailed(f"no live segment named {name!r} in etcd {self.url}")
        try:
            entry = json.loads(raw)
            host, port = entry["host"], entry["port"]
        except (ValueError, KeyError, TypeError) as e:
            raise TransferFailed(f"segment {name!r}: malformed etcd entry ({e!r})") from e
        if not isinstance(host, str) or type(port) is not int or not 0 < port < 65536:
            raise TransferFailed(f"segment {name!r}: malformed etcd entry {raw[:80]!r}")
        return host, port

    def close(self) -> None:
        """Give the name up now (the lease revoked). Idempotent; an unreachable etcd is logged."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join()
            self._keeper = None
        if self._lease:
            lease, self._lease = self._lease, 0
            try:
                self._etcd.revoke(lease)
            except StoreError as e:
                log.warning("close: etcd did not take the segment name's lease back (%s); it frees when it ends", e)

    def _keep(self) -> None:
        while not self._stop.wait(self._ttl_s / 3):
            try:
                if self._etcd.refresh(self._lease) <= 0:
                    log.error(
                        "the segment name's etcd lease lapsed (etcd away for %d s); peers no longer find it",
                        self._ttl_s,
                    )
                    return
            except StoreError as e:
                log.warning("segment name lease refresh failed (%s); retrying", e)
