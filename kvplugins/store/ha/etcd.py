"""The etcd v3 client of master HA: etcd3gw (etcd's HTTP/JSON gRPC gateway, /v3/ on etcd >= 3.4), key layout
under a cluster prefix, and fenced transactions (every write of the leader is conditional on the leader key
still holding its own value, so a deposed leader can never overwrite its successor's metadata).

Keys: ``{prefix}/leader`` (JSON {"raw", "zmq", "id"} under the leader's lease), ``{prefix}/seg/{name}``
(msgpack [descriptor wire, region id, size]), ``{prefix}/obj/{key}`` (journal.encode_object).
"""
from __future__ import annotations

import base64
import json

from kvplugins.errors import ConfigError, StoreError

MAX_TXN_OPS = 128          # etcd's default --max-txn-ops


def parse_endpoint(address: str) -> tuple[str, int, str]:
    """'etcd://host:port[/prefix]' or 'http://host:port' -> (host, port, prefix or ''). Raises ConfigError."""
    rest = address.split("://", 1)[1] if "://" in address else address
    hostport, slash, prefix = rest.partition("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"etcd address {address!r} must be etcd://host:port[/prefix] or http://host:port, "
                          "e.g. etcd://127.0.0.1:2379/kvplugins/default")
    return host.strip("[]"), int(port), (slash + prefix).rstrip("/")


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def put_op(key: str, value: bytes) -> dict:
    return {"request_put": {"key": b64(key), "value": b64(value)}}


def delete_op(key: str) -> dict:
    return {"request_delete_range": {"key": b64(key)}}


def _prefix_end(prefix: bytes) -> bytes:
    """The range end covering every key that starts with ``prefix`` (etcd's prefix convention)."""
    head = prefix.rstrip(b"\xff")
    return head[:-1] + bytes([head[-1] + 1]) if head else b"\0"


class Etcd:
    """One etcd endpoint (``http://host:port``), requests time out after ``timeout_s``.
    Every method raises StoreError (naming the URL) when etcd does not answer."""

    def __init__(self, url: str, timeout_s: float = 2.0):
        import etcd3gw
        host, port, _ = parse_endpoint(url)
        self.url = f"http://{host}:{port}"
        self.client = etcd3gw.client(host=host, port=port, timeout=timeout_s, api_path="/v3/")
        self._errors = (etcd3gw.exceptions.Etcd3Exception, OSError, ValueError)

    def _do(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            raise StoreError(f"etcd {self.url}: {what} failed: {e!r:.300}; is etcd running?") from e

    def get(self, key: str) -> bytes | None:
        values = self._do("get", self.client.get, key.encode())
        return values[0] if values else None

    def get_json(self, key: str) -> dict | None:
        raw = self.get(key)
        return json.loads(raw) if raw else None

    def range_prefix(self, prefix: str, page: int = 5000) -> list[tuple[str, bytes]]:
        """(key, value) of every key under ``prefix``, oldest modification first; read in pages of ``page``
        keys at one revision (a consistent snapshot of any size)."""
        start, end = prefix.encode(), _prefix_end(prefix.encode())
        rows, rev = [], None
        while True:
            req = {"key": b64(start), "range_end": b64(end), "limit": page, **({"revision": rev} if rev else {})}
            res = self._do("range", self.client.post, self.client.get_url("/kv/range"), json=req)
            rev = rev or int(res["header"]["revision"])
            kvs = res.get("kvs", [])
            rows += [(int(kv.get("mod_revision", 0)), base64.b64decode(kv["key"]).decode(),
                      base64.b64decode(kv.get("value", ""))) for kv in kvs]
            if not res.get("more") or not kvs:
                break
            start = base64.b64decode(kvs[-1]["key"]) + b"\0"
        rows.sort(key=lambda r: r[0])
        return [(k, v) for _, k, v in rows]

    def txn(self, compare: list[dict], success: list[dict]) -> bool:
        """One transaction; True if ``compare`` held (then ``success`` ran)."""
        result = self._do("txn", self.client.transaction, {"compare": compare, "success": success, "failure": []})
        return bool(result.get("succeeded", False))

    def value_is(self, key: str, value: bytes) -> dict:
        """A compare clause: ``key`` holds ``value``."""
        return {"key": b64(key), "result": "EQUAL", "target": "VALUE", "value": b64(value)}

    def lease(self, ttl_s: int):
        return self._do("lease grant", self.client.lease, ttl_s)

    def refresh(self, lease) -> int:
        """Keep ``lease`` alive; its remaining TTL in seconds, or <= 0 if it already expired."""
        return self._do("lease keepalive", lease.refresh)

    def revoke(self, lease) -> None:
        self._do("lease revoke", lease.revoke)

    def create(self, key: str, value: bytes, lease) -> bool:
        """Put ``key`` = ``value`` under ``lease`` only if ``key`` does not exist; True if it was created."""
        return bool(self._do("create", self.client.create, key.encode(), value, lease=lease))
