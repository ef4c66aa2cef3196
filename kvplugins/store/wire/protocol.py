"""The master's wire protocol, shared by both endpoints (raw framed TCP and zmq ROUTER).

Frame (raw endpoint): 4-byte big-endian unsigned length, then that many bytes of msgpack.
On zmq the msgpack body is one message part (zmq does the framing).

Request body:  [VERSION, request_id, op, entries, opts]
  op: str; entries: list (one per key/segment, the batch); opts: dict of batch-wide options.
Response body: [VERSION, request_id, ok, payload]
  ok true: payload is the op's result (usually a list, one result per entry: [code, value]).
  ok false: payload is an error string (unknown op, bad arguments); the connection stays open.
  Request id 0 is never sent: a response with id 0 and ok false is a refusal of the whole connection (over a
  connection limit); the server closes it after that frame.
A frame of another version, over max_frame, or not msgpack of this shape closes that connection
(the master logs why and keeps serving).
"""

from __future__ import annotations

import reprlib
import struct

import msgpack

from kvplugins.errors import KeyNotFound, ProtocolError, PutPending, StoreError, StoreFull

VERSION = 1
HEADER = struct.Struct(">I")

# Per-entry result codes: [code, value]
OK = 0
NOT_FOUND = 1
STORE_FULL = 2
EXISTS = 3  # put_start/put: the key is already stored (complete); the put is a no-op success
INVALID = 4  # bad entry (e.g. size <= 0); value names the problem
EXPIRED = 5  # put_commit: the pending object was reclaimed (writer too slow)
ON_DISK = 6  # get: the object is only on a node's disk tier; value tells the client how to promote it
PENDING = 7  # put_start/put: another writer's put of the key has not committed yet; retry (never "stored")
WRONG_SHARD = 8  # put_start/put on a sharded store: another shard owns the key; re-read the membership, retry
UNAVAILABLE = 9  # sharded store (client side): the key's shard did not answer; value names it (a miss for reads)
NOT_NOW = 10  # task_create: a valid request the store cannot run in its current state (a draining target)
UNREACHABLE = 11  # register_segment: the master's admission probe could not write and read the segment back

OPS = (
    "info",
    "put_start",
    "put_commit",
    "put_abort",
    "reserve",
    "put",
    "get",
    "exists",
    "exists_prefix",
    "remove",
    "status",
    "register_segment",
    "heartbeat",
    "unregister",
    "describe",
    "report_corrupt",
)
# put_start opts: store/placement.py PutConfig.wire. put_commit opts: {"xxh3": [checksum per entry]}.
# reserve / put: client-reserved slabs, one round trip per put (store/master/slabs.py); put opts as put_commit.
# get value: [size, [[segment, region id, offset], ...], lease ttl ms, xxh3_64 checksum or None]
# (the {"cols": 1} form: MasterService._get_cols). report_corrupt entries: [key, segment, offset, checksum].


def pack(obj: object) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


def unpack(body: bytes) -> object:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - any decoder failure is a malformed frame
        raise ProtocolError(f"frame is not valid msgpack: {e}") from e


def frame(obj: object) -> bytes:
    body = pack(obj)
    return HEADER.pack(len(body)) + body


def parse_request(msg: object) -> tuple[int, str, list[object], dict[str, object]]:
    """Validate a decoded request body. Raises ProtocolError naming what is wrong."""
    if not isinstance(msg, list) or len(msg) != 5:
        raise ProtocolError(f"request must be a 5-element array, got {type(msg).__name__}")
    version, rid, op, entries, opts = msg
    if version != VERSION:
        raise ProtocolError(f"request version {reprlib.repr(version)} unsupported (this master speaks {VERSION})")
    if (
        not isinstance(rid, int)
        or not isinstance(op, str)
        or not isinstance(entries, list)
        or not isinstance(opts, dict)
    ):
        raise ProtocolError("request fields must be [int version, int id, str op, list entries, dict opts]")
    return rid, op, entries, opts


def parse_response(msg: object, rid: int) -> tuple[bool, object]:
    """Validate a decoded response to request ``rid``; returns (ok, payload). Raises ProtocolError."""
    if not isinstance(msg, list) or len(msg) != 4 or msg[0] != VERSION:
        raise ProtocolError(f"malformed response from master: {reprlib.repr(msg)}")
    if msg[1] == 0 and msg[2] is False:  # id 0 is no request's: the server refused the connection
        reason = msg[3] if isinstance(msg[3], str) else reprlib.repr(msg[3])
        raise ProtocolError(reason[:1000])  # "connection refused: <reason, naming the limit>"
    if msg[1] != rid:
        raise ProtocolError(f"response id {msg[1]} does not match request {rid}")
    return bool(msg[2]), msg[3]


def entry_error(code: int, key: str, detail: str) -> StoreError:
    """The StoreError a client raises for a failed entry."""
    if code == NOT_FOUND:
        return KeyNotFound(key)
    if code == STORE_FULL:
        return StoreFull(f"{key}: {detail}")
    if code == PENDING:
        return PutPending(f"{key}: {detail}")
    return StoreError(f"{key}: {detail}")


NOT_LEADER = "not leader"  # how an HA standby's refusals start (clients re-resolve the leader on it)
