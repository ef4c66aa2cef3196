"""KV events: what the store holds, published for cache-aware routers (issue #15).

The master records an event wherever an object's presence changes, and after each request (and each sweep)
publishes what was recorded as one batch on a zmq PUB socket, framed as vLLM 0.32's ``ZmqEventPublisher``
(vllm/distributed/kv_events.py) frames its KV events, so a router that reads vLLM's stream reads ours with the
same code:

* PUB multipart ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian signed batch number from 0, ``payload``
  msgpack of ``[ts, [event, ...]]`` (vLLM's ``KVEventBatch``, array-like).
* an event is vLLM's tagged map: ``{"type": "BlockStored", "block_hashes": [key], "parent_block_hash": None,
  "token_ids": [], "block_size": 0, "lora_id": None, "medium": medium, "lora_name": None,
  "reason": reason}`` or
  ``{"type": "BlockRemoved", "block_hashes": [key], "medium": medium, "reason": reason}``; ``key`` is the object
  key as UTF-8 bytes, ``medium`` "CPU" (a DRAM replica) or "STORAGE" (the disk tier), and ``reason`` (a field
  vLLM's decoder ignores; omitted when it is the default, "stored" / "removed") one of stored, evicted, removed,
  offloaded, promoted, lost, corrupt.
* both sockets are CURVE servers like the master's control plane (security/curve.py): a subscriber holding the
  secret or any role credential sets its CURVE keys before connecting (``curve.client_socket(sock, keys)``);
  one without them gets nothing, not even the key names. vLLM's framing is unchanged; a router written for
  vLLM's stream adds the three CURVE socket options.
* replay: a ROUTER socket; a client (DEALER) sends ``(b"", start_seq)`` and receives every buffered batch with
  ``seq >= start_seq`` as ``(b"", topic, seq, payload)``, then ``(b"", b"", -1, b"")``. The last
  ``events_buffer`` batches are kept. A request of another shape is logged and dropped; other subscribers are not
  affected.

Not published: pending puts (never visible to readers), and a segment's replicas lost while the object keeps
another. Sequence numbers restart when a master (or an HA leader) starts. Source followed: vLLM 0.32
``ZmqEventPublisher`` / ``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved``.
"""

from __future__ import annotations

import collections
import logging
import time

import msgspec
import zmq

from kvplugins.security.curve import server_socket
from kvplugins.store.wire.kv_events import BlockRemoved, BlockStored, EventBatch

__all__ = ["BlockRemoved", "BlockStored", "EventBatch", "EventPublisher", "NoEvents"]
log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
CPU, STORAGE = "CPU", "STORAGE"


class NoEvents:
    """The recorder the service calls (every hook a no-op): events off. ``keeps``: whether the hooks do
    anything (False here: a batch op may skip building the objects it would pass them)."""

    keeps = False

    def stored(self, objs: list, reason: str = "stored") -> None:
        """``objs`` (metadata.Object) became readable: committed, or found on a node's disk."""

    def removed(self, objs: list, reason: str) -> None:
        """Committed ``objs`` left the table (removed, evicted, lost every replica, last replica corrupt)."""

    def offloaded(self, objs: list) -> None:
        """``objs`` now live on the disk tier only."""

    def promoted(self, objs: list) -> None:
        """``objs`` got a DRAM replica back from the disk tier."""

    def flush(self) -> None:
        """Publish what was recorded since the last flush as one batch."""

    def close(self) -> None:
        pass


class EventPublisher(NoEvents):
    """Records events and publishes them (see the module docstring). ``ctx``: the zmq.Context of the master's
    CurveServer (its ZAP handler admits subscribers); ``secret``: the cluster secret (the sockets' CURVE keys);
    ``endpoint`` and ``replay_endpoint``: zmq bind addresses (e.g. ``tcp://127.0.0.1:0``; the bound ones are in
    ``endpoints``)."""

    keeps = True

    def __init__(self, ctx, secret, endpoint: str, replay_endpoint: str, topic: str = "kvplugins", buffer: int = 10000):
        self._zmq = zmq
        self._topic = topic.encode()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        server_socket(self._pub, secret)
        self._pub.bind(endpoint)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        server_socket(self.replay, secret)
        self.replay.bind(replay_endpoint)
        self.endpoints = (
            self._pub.getsockopt_string(zmq.LAST_ENDPOINT),
            self.replay.getsockopt_string(zmq.LAST_ENDPOINT),
        )
        self._buffer: collections.deque = collections.deque(maxlen=buffer)
        self._pending: list = []
        self._seq = 0
        self._enc = msgspec.msgpack.Encoder()

    def stored(self, objs: list, reason: str = "stored") -> None:
        for o in objs:
            self._pending.append(BlockStored([o.key.encode()], None, [], 0, None, _medium(o), None, reason=reason))

    def removed(self, objs: list, reason: str) -> None:
        for o in objs:
            self._pending.append(BlockRemoved([o.key.encode()], _medium(o), reason=reason))

    def offloaded(self, objs: list) -> None:
        for o in objs:
            self._pending.append(BlockRemoved([o.key.encode()], CPU, reason="offloaded"))
            self._pending.append(BlockStored([o.key.encode()], None, [], 0, None, STORAGE, None, reason="offloaded"))

    def promoted(self, objs: list) -> None:
        self.stored(objs, "promoted")

    def flush(self) -> None:
        if not self._pending:
            return
        payload = self._enc.encode(EventBatch(time.time(), self._pending))
        self._pending = []
        seq = self._seq.to_bytes(8, "big", signed=True)
        self._buffer.append((seq, payload))
        self._seq += 1
        try:
            self._pub.send_multipart((self._topic, seq, payload), flags=self._zmq.NOBLOCK)
        except self._zmq.Again:  # a PUB drops what its subscribers cannot take; the replay window keeps it
            pass

    def serve_replay(self) -> None:
        """Answer every replay request waiting on the ROUTER (call when its descriptor is readable)."""
        zmq = self._zmq
        while self.replay.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = self.replay.recv_multipart(flags=zmq.NOBLOCK)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning(
                    "events replay: dropped a request of %d frames (want: identity, b'', 8-byte start sequence)",
                    len(frames),
                )
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            try:
                for seq, payload in list(self._buffer):
                    if int.from_bytes(seq, "big", signed=True) >= start:
                        self.replay.send_multipart((client, b"", self._topic, seq, payload), flags=zmq.NOBLOCK)
                self.replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:  # that client reads too slowly: its replay is cut short, nobody else waits
                log.warning("events replay: a client's queue is full; its replay was cut short")

    def close(self) -> None:
        self._pub.close(0)
        self.replay.close(0)


def _medium(obj) -> str:
    return CPU if obj.replicas else STORAGE
