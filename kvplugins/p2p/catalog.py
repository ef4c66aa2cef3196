"""The P2P store's catalog in etcd (the store's etcd v3 client, kvplugins/store/cluster/etcd.py).

Keys under the etcd address's prefix (``etcd://host:port/prefix``; ``/kvplugins`` when none), names
percent-quoted so one name is never a key prefix of another's holders:

- ``{prefix}/p2p/obj/{name}``: a ``Payload`` (JSON): what the object is, cut into chunks with their xxh3_64.
  Written once by the peer that registers it (create-if-absent; ``force`` replaces it under a new generation),
  kept when that peer leaves (its replicas still serve it), deleted by the last holder that unregisters.
- ``{prefix}/p2p/hold/{name}/{peer}``: a ``Holder`` (JSON) under the holding peer's etcd lease: where its copy
  lies (its transfer descriptor, a region per buffer) and which chunks it has verified. A peer that dies
  vanishes when its lease ends (P2PConfig.lease_ttl_s); a pulling peer rewrites its record as chunks land.

Nothing read here is trusted: every record is decoded into typed structs and checked for shape (chunks that tile
each buffer, a bitmap of the right length, a well-formed descriptor) before use; a malformed holder is skipped
with a warning, a malformed payload raises ProtocolError. The bytes themselves are checked against the chunk's
xxh3_64 after every read (kvplugins/p2p/pull.py). Mooncake's P2P Store (mooncake-p2p-store/src/p2pstore,
metadata.go) keeps one JSON record per object with its gold and replica locations and no checksums; replicas
there are listed only once a whole get_replica finished and stay listed after their peer died.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse

import msgspec

from kvplugins.errors import ProtocolError
from kvplugins.store.cluster.etcd import Etcd, delete_op, parse_endpoint, put_op
from kvplugins.transfer import SegmentDescriptor

log = logging.getLogger(__name__)

MAX_CHUNKS = 1 << 20
MAX_NAME = 1024


class Chunk(msgspec.Struct, array_like=True, frozen=True):
    """Bytes [offset, offset + length) of buffer ``buffer``, whose xxh3_64 is ``xxh3``."""

    buffer: int
    offset: int
    length: int
    xxh3: int


class Payload(msgspec.Struct, frozen=True):
    """An object: ``sizes`` (bytes per buffer, in order), cut into ``chunks`` of at most ``chunk_bytes``
    (buffer by buffer, in order). ``gen``: this registration's id (a forced re-registration gets a new one,
    and holders of the old one are ignored). ``owner``: the registering peer's segment id. ``labels``: none, or
    one per buffer (a checkpoint's file names: kvplugins/p2p/checkpoint.py checks them as paths)."""

    name: str
    gen: str
    sizes: list[int]
    chunk_bytes: int
    chunks: list[Chunk]
    owner: str
    created_ms: int
    labels: list[str] = msgspec.field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(self.sizes)


class Holder(msgspec.Struct, frozen=True):
    """A peer's copy of a payload: its transfer ``descriptor`` (SegmentDescriptor.to_wire()), the region id of
    each buffer, and ``have``: a bitmap of the chunks it verified (bit i of byte i // 8); ``pending``: one of
    the chunks it is reading now (empty: none), so other pullers do not ask the registering peer for the same
    chunk at once, and ``reading_from``: the peer of each of those reads, so pullers spread their reads over the
    holders' egress. ``gold``: the registering peer (serves its own memory)."""

    gen: str
    peer: str
    gold: bool
    descriptor: dict[str, object]
    regions: list[int]
    have: bytes
    pending: bytes = b""
    reading_from: list[str] = msgspec.field(default_factory=list)

    def has(self, chunk: int) -> bool:
        return bool(self.have[chunk >> 3] >> (chunk & 7) & 1)

    def reads(self, chunk: int) -> bool:
        return bool(self.pending) and bool(self.pending[chunk >> 3] >> (chunk & 7) & 1)


def cut(sizes: list[int], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(buffer, offset, length) of each chunk of buffers ``sizes`` (bytes) cut at ``chunk_bytes``."""
    return [
        (b, off, min(chunk_bytes, size - off)) for b, size in enumerate(sizes) for off in range(0, size, chunk_bytes)
    ]


def check_payload(p: Payload) -> Payload:
    """``p`` if its chunks tile its buffers as ``cut`` does; else ProtocolError naming what is wrong."""
    if not p.sizes or any(s <= 0 for s in p.sizes) or p.chunk_bytes <= 0:
        raise ProtocolError(f"p2p payload {p.name!r}: sizes {p.sizes[:4]!r} / chunk_bytes {p.chunk_bytes} not positive")
    if len(p.chunks) > MAX_CHUNKS or [(c.buffer, c.offset, c.length) for c in p.chunks] != cut(p.sizes, p.chunk_bytes):
        raise ProtocolError(f"p2p payload {p.name!r}: its chunks do not tile its buffers at {p.chunk_bytes} bytes")
    if p.labels and (len(p.labels) != len(p.sizes) or any(len(x) > MAX_NAME for x in p.labels)):
        raise ProtocolError(
            f"p2p payload {p.name!r}: {len(p.labels)} labels for {len(p.sizes)} buffers, or one too long"
        )
    if any(not 0 <= c.xxh3 < 1 << 64 for c in p.chunks):
        raise ProtocolError(f"p2p payload {p.name!r}: a chunk checksum is not a uint64")
    return p


def check_holder(p: Payload, h: Holder) -> SegmentDescriptor:
    """The descriptor of holder ``h`` of ``p`` once ``h`` fits ``p`` (a region per buffer, each large enough, a
    bitmap of one bit per chunk); else ProtocolError."""
    if (
        len(h.regions) != len(p.sizes)
        or len(h.have) != (len(p.chunks) + 7) // 8
        or len(h.pending) not in (0, len(h.have))
        or len(h.reading_from) > 1024
    ):
        raise ProtocolError(
            f"p2p holder {h.peer!r} of {p.name!r}: {len(h.regions)} regions / bitmap of {len(h.have)} bytes"
        )
    desc = SegmentDescriptor.from_wire(h.descriptor)
    for rid, size in zip(h.regions, p.sizes):
        try:
            length = desc.region(rid).length
        except Exception as e:  # OutOfRange: no such region
            raise ProtocolError(f"p2p holder {h.peer!r} of {p.name!r}: {e}") from e
        if length < size:
            raise ProtocolError(f"p2p holder {h.peer!r} of {p.name!r}: region {rid} of {length} bytes < {size}")
    return desc


def check_name(name: object) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or "\0" in name:
        raise ProtocolError(
            f"p2p object name {name!r:.80} must be a non-empty string of at most {MAX_NAME} characters without NUL"
        )
    return name


def _q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class Catalog:
    """The catalog at etcd ``url`` (as parse_endpoint takes it). Thread-safe (an etcd client per thread).
    Every method raises StoreError when etcd does not answer."""

    def __init__(self, url: str, timeout_s: float = 2.0):
        _, prefix = parse_endpoint(url)
        self.url, self._timeout_s = url, timeout_s
        self._base = (prefix or "/kvplugins") + "/p2p"
        self._local = threading.local()

    @property
    def etcd(self) -> Etcd:
        e = getattr(self._local, "etcd", None)
        if e is None:
            e = self._local.etcd = Etcd(self.url, self._timeout_s)
        return e

    def _obj(self, name: str) -> str:
        return f"{self._base}/obj/{_q(name)}"

    def _hold(self, name: str, peer: str = "") -> str:
        return f"{self._base}/hold/{_q(name)}/{_q(peer) if peer else ''}"

    def create(self, p: Payload, force: bool) -> bool:
        """Write ``p``; unless ``force``, only where no payload of that name exists. True if written."""
        value = msgspec.json.encode(p)
        if force:
            return self.etcd.txn([], [put_op(self._obj(p.name), value)])
        return self.etcd.create(self._obj(p.name), value, 0)

    def get(self, name: str) -> Payload | None:
        """The payload ``name``, or None. Raises ProtocolError for a malformed record."""
        raw = self.etcd.get(self._obj(check_name(name)))
        return None if raw is None else _payload(raw)

    def payloads(self, prefix: str = "") -> list[Payload]:
        """Every payload whose name starts with ``prefix``, oldest first (malformed ones skipped, logged)."""
        out = []
        for key, raw in self.etcd.range_prefix(self._obj(prefix) if prefix else f"{self._base}/obj/"):
            try:
                out.append(_payload(raw))
            except ProtocolError as e:
                log.warning("p2p catalog: skipping %s: %s", key, e)
        return out

    def holders(self, p: Payload) -> list[tuple[Holder, SegmentDescriptor]]:
        """The live holders of ``p``'s generation that fit it, with their descriptors (others skipped)."""
        out = []
        for key, raw in self.etcd.range_prefix(self._hold(p.name)):
            try:
                h = msgspec.json.decode(raw, type=Holder)
                if h.gen == p.gen:
                    out.append((h, check_holder(p, h)))
            except (msgspec.ValidationError, msgspec.DecodeError, ProtocolError) as e:
                log.warning("p2p catalog: skipping holder %s: %s", key, e)
        return out

    def publish(self, name: str, h: Holder, lease: int) -> None:
        """Write holder ``h`` of ``name`` under etcd lease ``lease``."""
        op = put_op(self._hold(name, h.peer), msgspec.json.encode(h))
        op["request_put"]["lease"] = lease
        self.etcd.txn([], [op])

    def withdraw(self, name: str, peer: str) -> None:
        self.etcd.txn([], [delete_op(self._hold(name, peer))])

    def delete_if_unheld(self, p: Payload) -> bool:
        """Delete payload ``p`` (that very record) when no holder of any generation is left. True if deleted."""
        if self.etcd.range_prefix(self._hold(p.name)):
            return False
        return self.etcd.txn(
            [self.etcd.value_is(self._obj(p.name), msgspec.json.encode(p))], [delete_op(self._obj(p.name))]
        )


def _payload(raw: bytes) -> Payload:
    try:
        return check_payload(msgspec.json.decode(raw, type=Payload))
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ProtocolError(f"malformed p2p payload record: {e}") from e
