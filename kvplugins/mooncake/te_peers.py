"""Mooncake Transfer Engine segments on kvplugins.transfer: what a process publishes (its registered buffers by
address, beside its SegmentDescriptor) and what it learns of a peer named ``host:port`` (Mooncake's P2PHANDSHAKE
segment name: the peer's TCP server). Used by te.py; the wire is two control kinds on the transfer core's
authenticated TCP connections:

- ``SEGMENT``: reply ``{"descriptor": SegmentDescriptor.to_wire(), "buffers": [[address, bytes, region id], ...]}``,
  each as JSON text (a control reply is a flat map: its text may be up to wire.MAX_HEADER long), the buffers in
  registration order (Mooncake's ``get_first_buffer_address`` is the first);
- ``NOTIFY``: ``{"name", "msg"}`` queued for the peer's ``get_notifies`` (a transfer_sync with ``notify``).

A peer's addresses are its own process's: they only pick (region id, offset) on our side; the peer's transport
checks every span against its region before it moves a byte (kvplugins/transfer), so a wrong or hostile
address list can fail a transfer, never reach memory outside the peer's exported regions.
"""

from __future__ import annotations

import bisect
import json
import threading
from dataclasses import dataclass

import numpy as np

from kvplugins.errors import ProtocolError, TransferFailed
from kvplugins.store.client.rpc import parse_address
from kvplugins.transfer import SegmentDescriptor, TransferEngine

SEGMENT, NOTIFY = "mooncake.segment", "mooncake.notify"
MAX_NOTIFIES = 65536  # queued notifies kept; the oldest go first when nobody drains them


@dataclass(frozen=True)
class Peer:
    """A peer segment: its descriptor and its buffers as (address, bytes, region id), sorted by address."""

    descriptor: SegmentDescriptor
    buffers: tuple[tuple[int, int, int], ...]
    first: int  # the address of the buffer it registered first, 0 when none

    def locate_many(self, addrs: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(region ids, offsets) of each span [addrs[j], addrs[j] + lengths[j]) (uint64 arrays) inside one of the
        peer's buffers, or None when one is not."""
        bases = np.fromiter((b[0] for b in self.buffers), np.uint64, len(self.buffers))
        i = np.searchsorted(bases, addrs, side="right").astype(np.int64) - 1
        if not len(self.buffers) or (i < 0).any():
            return None
        sizes = np.fromiter((b[1] for b in self.buffers), np.uint64, len(self.buffers))
        offs = addrs - bases[i]
        if (offs + lengths > sizes[i]).any():
            return None
        return np.fromiter((b[2] for b in self.buffers), np.uint64, len(self.buffers))[i], offs

    def locate(self, addr: int, length: int) -> tuple[int, int] | None:
        """(region id, offset) of the peer's bytes [addr, addr + length), inside one of its buffers, or None."""
        i = bisect.bisect_right(self.buffers, (addr, 1 << 64, 1 << 64)) - 1
        if i < 0:
            return None
        base, size, region = self.buffers[i]
        return (region, addr - base) if addr + length <= base + size else None


def parse_name(name: object) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port). Raises ConfigError naming the value."""
    return parse_address(name, "segment name", "the peer's host and get_rpc_port(), 10.0.0.2:15000")  # type: ignore[arg-type]


def peer_from_wire(reply: object) -> Peer:
    """A Peer from a SEGMENT reply. Raises ProtocolError for a malformed one."""
    try:
        desc = SegmentDescriptor.from_wire(json.loads(reply["descriptor"]))  # type: ignore[index]
        rows = [(int(a), int(n), int(r)) for a, n, r in json.loads(reply["buffers"])]  # type: ignore[index]
    except (KeyError, TypeError, ValueError, ProtocolError) as e:
        raise ProtocolError(f"malformed Mooncake segment reply: {e!r}") from e
    if any(a < 0 or n <= 0 or a + n > 1 << 64 for a, n, _ in rows):
        raise ProtocolError("malformed Mooncake segment reply: a buffer of no bytes or past the address space")
    return Peer(desc, tuple(sorted(rows)), rows[0][0] if rows else 0)


class Segments:
    """This process's side of the segment wire on ``engine``: serves SEGMENT and NOTIFY, keeps the buffers it
    registered (``add``/``remove``), the notifies received (``take_notifies``) and the peers it opened
    (``open``/``forget``). Thread-safe."""

    def __init__(self, engine: TransferEngine, timeout_ms: float, resolve=None):
        """``resolve(name) -> (host, port)``: where segment ``name``'s server is (default: the name is
        ``host:port``, P2PHANDSHAKE; te_names.EtcdNames.lookup in etcd mode)."""
        self._engine, self._timeout_ms = engine, timeout_ms
        self._resolve = resolve or parse_name
        self._lock = threading.Lock()
        self._buffers: dict[int, tuple[int, int]] = {}  # address -> (bytes, region id), in registration order
        self._peers: dict[str, Peer] = {}
        self._notifies: list[tuple[str, str]] = []
        engine.serve_control(SEGMENT, self._serve_segment)
        engine.serve_control(NOTIFY, self._serve_notify)

    def add(self, addr: int, length: int, region_id: int) -> None:
        with self._lock:
            self._buffers[addr] = (length, region_id)

    def remove(self, addr: int) -> None:
        with self._lock:
            self._buffers.pop(addr, None)

    def open(self, name: str, fresh: bool = False) -> Peer:
        """The peer segment ``name`` (cached; asked again when ``fresh``). Raises ConfigError (a bad name),
        TransferFailed (unreachable, refused, timeout) or ProtocolError (a malformed reply)."""
        with self._lock:
            peer = None if fresh else self._peers.get(name)
        if peer is None:
            host, port = self._resolve(name)
            peer = peer_from_wire(self._engine.control(host, port, {"kind": SEGMENT}, self._timeout_ms))
            with self._lock:
                self._peers[name] = peer
        return peer

    def forget(self, name: str) -> None:
        with self._lock:
            self._peers.pop(name, None)

    def notify(self, name: str, who: str, msg: str) -> None:
        """Queue (``who``, ``msg``) at peer ``name``. Raises as ``open``."""
        host, port = self._resolve(name)
        self._engine.control(host, port, {"kind": NOTIFY, "name": who, "msg": msg}, self._timeout_ms)

    def take_notifies(self) -> list[tuple[str, str]]:
        with self._lock:
            out, self._notifies = self._notifies, []
        return out

    def _serve_segment(self, body: dict, addr) -> dict:
        with self._lock:
            rows = [[a, n, r] for a, (n, r) in self._buffers.items()]
        return {"descriptor": json.dumps(self._engine.descriptor().to_wire()), "buffers": json.dumps(rows)}

    def _serve_notify(self, body: dict, addr) -> dict:
        name, msg = body.get("name"), body.get("msg")
        if not isinstance(name, str) or not isinstance(msg, str):
            raise TransferFailed("a notify carries a str name and a str msg")
        with self._lock:
            self._notifies.append((name, msg))
            del self._notifies[:-MAX_NOTIFIES]
        return {}
