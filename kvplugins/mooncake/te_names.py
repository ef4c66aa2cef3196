"""Mooncake Transfer Engine segment names in etcd or an HTTP metadata server (HttpNames, below). Etcd (its etcd metadata mode: ``initialize(name,
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
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request

from kvplugins.errors import ConfigError, StoreError, TransferFailed
from kvplugins.store.cluster.etcd import Etcd, parse_endpoint

log = logging.getLogger("kvplugins.mooncake.te")
TTL_S = 10
MAX_ENTRY = 4096  # bytes of a metadata server's answer read


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


class HttpNames:
    """Names in a Mooncake HTTP metadata server (``http://host:port/metadata``: GET, PUT and DELETE of ``?key=``;
    Mooncake's ``mooncake_http_metadata_server``, or the one ``mooncake_master --enable_http_metadata_server``
    embeds): ``mooncake/rpc_meta/{name}`` = ``{"ip_or_host_name", "rpc_port"}``, the key and JSON Mooncake writes.
    The server keeps no lease, so a name whose server no longer accepts connections counts as free (its entry is
    replaced); a live one's is refused. What it says is a peer's word: it only tells where to connect, and our
    connections authenticate both ends (the cluster secret), so a forged entry can fail a transfer, never divert
    its bytes. Thread-safe."""

    def __init__(self, url: str, timeout_s: float = 5.0):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"metadata server {url!r}: an HTTP one is http://host:port/metadata")
        self.url, self._timeout_s = url, timeout_s
        self._held: str | None = None

    def publish(self, name: str, host: str, port: int) -> None:
        """Claim ``name`` for the server at ``host``:``port``. Raises TransferFailed when a live process holds it,
        StoreError when the metadata server does not answer as one."""
        held = self._get(name)
        if held is not None:
            if _answers(*held):
                raise TransferFailed(
                    f"segment name {name!r} is held by a live process ({held[0]}:{held[1]}); pick another"
                )
            self._call("DELETE", name)  # a dead process's entry
        status, _ = self._call("PUT", name, json.dumps({"ip_or_host_name": host, "rpc_port": port}).encode())
        if status != 200:
            raise TransferFailed(f"segment name {name!r}: the metadata server {self.url} refused it (HTTP {status})")
        self._held = name

    def lookup(self, name: str) -> tuple[str, int]:
        """(host, port) of the server named ``name``. Raises TransferFailed (no such segment, a malformed entry) or
        StoreError (the metadata server)."""
        held = self._get(name)
        if held is None:
            raise TransferFailed(f"no segment named {name!r} in the metadata server {self.url}")
        return held

    def close(self) -> None:
        """Give the name up (its entry deleted). Idempotent; an unreachable server is logged."""
        name, self._held = self._held, None
        if name is not None:
            try:
                self._call("DELETE", name)
            except StoreError as e:
                log.warning("close: the metadata server did not delete segment name %r (%s)", name, e)

    def _get(self, name: str) -> tuple[str, int] | None:
        status, raw = self._call("GET", name)
        if status == 404:
            return None
        try:
            entry = json.loads(raw)
            host, port = entry["ip_or_host_name"], entry["rpc_port"]
        except (ValueError, KeyError, TypeError) as e:
            raise TransferFailed(f"segment {name!r}: malformed metadata entry ({e!r})") from e
        if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 65536:
            raise TransferFailed(f"segment {name!r}: malformed metadata entry {raw[:80]!r}")
        return host, port

    def _call(self, method: str, name: str, body: bytes | None = None) -> tuple[int, bytes]:
        key = urllib.parse.quote("mooncake/rpc_meta/" + name, safe="")
        req = urllib.request.Request(f"{self.url}?key={key}", data=body, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self._timeout_s) as r:
                return r.status, r.read(MAX_ENTRY)
        except urllib.error.HTTPError as e:
            if e.code in (400, 404):
                return e.code, b""
            raise StoreError(f"metadata server {self.url}: {method} of {name!r} answered HTTP {e.code}") from e
        except (OSError, ValueError) as e:
            raise StoreError(f"metadata server {self.url} did not answer {method} of {name!r}: {e}") from e


def _answers(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``host``:``port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
