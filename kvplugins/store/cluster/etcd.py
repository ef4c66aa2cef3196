"""The etcd v3 client of master HA: etcd3gw (etcd's HTTP/JSON gRPC gateway, /v3/ on etcd >= 3.4), key layout
under a cluster prefix, and fenced transactions (every write of the leader is conditional on the leader key
still holding its own value, so a deposed leader can never overwrite its successor's metadata).

Keys: ``{prefix}/leader`` (JSON {"raw", "zmq", "id"} under the leader's lease), ``{prefix}/seg/{name}``
(msgpack [descriptor wire, region id, size]), ``{prefix}/obj/{key}`` (journal.encode_object).
"""

from __future__ import annotations

import base64
import json
import time

from kvplugins.errors import ConfigError, StoreError

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


def parse_endpoint(address: str) -> tuple[list[tuple[str, int]], str]:
    """'etcd://host:port[,host:port...][/prefix]' or 'http://host:port[,http://host:port...]' ->
    ([(host, port), ...], prefix or ''). Several endpoints = members of one etcd cluster. Raises ConfigError."""
    if address.count("://") > 1:  # a list of URLs: http://a:1,http://b:2
        hostports = ",".join(u.split("://", 1)[-1].strip().rstrip("/") for u in address.split(","))
        slash = prefix = ""
    else:
        hostports, slash, prefix = (address.split("://", 1)[1] if "://" in address else address).partition("/")
    endpoints = []
    for hp in hostports.split(","):
        host, sep, port = hp.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(
                f"etcd address {address!r} must be etcd://host:port[,host:port][/prefix] or "
                "http://host:port[,http://host:port], e.g. etcd://127.0.0.1:2379/kvplugins/default"
            )
        endpoints.append((host.strip("[]"), int(port)))
    return endpoints, (slash + prefix).rstrip("/")


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
    """A client of one etcd cluster (``http://host:port``, or a comma list of its members: a request that
    cannot reach one member goes to the next); requests time out after ``timeout_s``. Every method raises
    StoreError (naming the URLs) when no member answers. One instance per thread."""

    def __init__(self, url: str, timeout_s: float = 2.0):
        import etcd3gw

        endpoints, _ = parse_endpoint(url)
        self.url = ",".join(f"http://{host}:{port}" for host, port in endpoints)
        self._clients = [
            etcd3gw.client(host=host, port=port, timeout=timeout_s, api_path="/v3/") for host, port in endpoints
        ]
        self._cur, self._timeout_s = 0, timeout_s
        exc = etcd3gw.exceptions
        self._down = (exc.ConnectionFailedError, exc.ConnectionTimeoutError, OSError)
        self._errors = (exc.Etcd3Exception, ValueError)

    @property
    def client(self):
        return self._clients[self._cur]

    def _do(self, what: str, fn, *args, deadline: float | None = None, **kwargs):
        """``fn(client, *args, **kwargs)`` on the current member, then on the next ones while they are down.
        ``deadline`` (time.monotonic() s): every member's attempt together ends by then (each waits at most
        ``timeout_s`` and what is left), so an unreachable cluster of N members costs the caller's timeout, not
        N member timeouts."""
        last = None
        for _ in self._clients:
            client, left = self.client, self._timeout_s
            if deadline is not None:
                left = min(left, deadline - time.monotonic())
                if left <= 0.01:
                    break
            client.timeout = left  # etcd3gw's per-client request timeout (one Etcd per thread)
            try:
                return fn(client, *args, **kwargs)
            except self._down as e:
                last = e
                self._cur = (self._cur + 1) % len(self._clients)
            except self._errors as e:
                raise StoreError(f"etcd {self.url}: {what} failed: {e!r:.300}") from e
        if last is None:
            raise StoreError(f"etcd {self.url}: {what} not sent: its deadline had passed")
        raise StoreError(f"etcd {self.url}: {what} failed: {last!r:.300}; is etcd running?") from last

    def _post(self, client, path: str, body: dict) -> dict:
        return client.post(client.get_url(path), json=body)

    def get(self, key: str, deadline: float | None = None) -> bytes | None:
        """The value of ``key``, or None; ``deadline``: as ``_do``."""
        values = self._do("get", lambda c: c.get(key.encode()), deadline=deadline)
        return values[0] if values else None

    def get_json(self, key: str, deadline: float | None = None) -> dict | None:
        raw = self.get(key, deadline)
        return json.loads(raw) if raw else None

    def range_prefix(self, prefix: str, page: int = 50_000) -> list[tuple[str, bytes]]:
        """(key, value) of every key under ``prefix``, oldest modification first; read in pages of ``page``
        keys at one revision (a consistent snapshot of any size). etcd walks the rest of the range on every
        page (it counts it), so reading N keys costs O(N^2 / page): at 1 M journaled objects pages of 5,000
        took 42 s, pages of 50,000 13 s (benchmarks/master_recovery.py); a page is ~15 MB of JSON."""
        start, end = prefix.encode(), _prefix_end(prefix.encode())
        rows, rev = [], None
        while True:
            req = {"key": b64(start), "range_end": b64(end), "limit": page, **({"revision": rev} if rev else {})}
            res = self._do("range", self._post, "/kv/range", req)
            rev = rev or int(res["header"]["revision"])
            kvs = res.get("kvs", [])
            rows += [
                (
                    int(kv.get("mod_revision", 0)),
                    base64.b64decode(kv["key"]).decode("utf-8", "surrogateescape"),
                    base64.b64decode(kv.get("value", "")),
                )
                for kv in kvs
            ]
            if not res.get("more") or not kvs:
                break
            start = base64.b64decode(kvs[-1]["key"]) + b"\0"
        rows.sort(key=lambda r: r[0])
        return [(k, v) for _, k, v in rows]

    def txn(self, compare: list[dict], success: list[dict]) -> bool:
        """One transaction; True if ``compare`` held (then ``success`` ran)."""
        result = self._do("txn", self._post, "/kv/txn", {"compare": compare, "success": success, "failure": []})
        return bool(result.get("succeeded", False))

    def value_is(self, key: str, value: bytes) -> dict:
        """A compare clause: ``key`` holds ``value``."""
        return {"key": b64(key), "result": "EQUAL", "target": "VALUE", "value": b64(value)}

    def lease(self, ttl_s: int) -> int:
        """Grant a lease of ``ttl_s`` seconds; its id."""
        return int(self._do("lease grant", self._post, "/lease/grant", {"TTL": ttl_s})["ID"])

    def refresh(self, lease: int) -> int:
        """Keep ``lease`` alive; its remaining TTL in seconds, or <= 0 if it already expired."""
        return int(self._do("lease keepalive", self._post, "/lease/keepalive", {"ID": lease})["result"].get("TTL", -1))

    def revoke(self, lease: int) -> None:
        self._do("lease revoke", self._post, "/kv/lease/revoke", {"ID": lease})

    def create(self, key: str, value: bytes, lease: int) -> bool:
        """Put ``key`` = ``value`` under ``lease`` only if ``key`` does not exist; True if it was created."""
        absent = {"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        put = put_op(key, value)
        put["request_put"]["lease"] = lease
        return self.txn([absent], [put])
