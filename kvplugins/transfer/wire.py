"""TCP wire format of the transfer core, version 1.

Frame = prefix (16 bytes, little-endian: magic b"KVPT", u32 header_len, u64 payload_len)
        + msgpack header (header_len bytes) + raw payload (payload_len bytes).
Request header:  {"v": 1, "op": 1 (write) | 2 (read), "id": u63, "e": [[region u32, offset u63, length u63], ...],
                  optional "dl": u63}
                 a write's payload is the entries' bytes concatenated; a read's payload is empty. "dl" (a write's
                 deadline, unix ms): a server whose clock is past it when the header, or any later part of the
                 payload, is read drops the rest of the frame and answers every entry LATE_WRITE + why (none of
                 the frame counts as written). The store sends it for writes into space a grant holds only until
                 then (a writer's or a node's stall must not land bytes in space given to another object since);
                 hosts' clocks must agree within the grant's margin (NTP).
Response header: {"v": 1, "op": 3, "id": same id, "st": [None | "error text", ...]} one status per entry;
                 a read response's payload is the bytes of the entries whose status is None, in order.
Control request: {"v": 1, "op": 4, "id": u63, "c": {"kind": str, ...}} with an empty payload: connection set-up of
                 another transport over this authenticated connection (the RDMA transport's QP exchange); the
                 response carries one status and "c": the handler's reply (a flat map of scalars and lists; its
                 strings may be up to MAX_HEADER long, a request's up to 256).
Refusal:         a response with id 0 (no request uses it) and one status, the reason, sent by a server over a
                 connection limit before it closes the connection (tcp_server.py, security/limits.py).
Limits: header_len <= MAX_HEADER, header_len + payload_len <= max_frame (config), at most MAX_ENTRIES
entries, and a read's total length <= max_frame - MAX_HEADER. Headers are decoded straight into typed,
range-checked structures (msgspec; an unknown or missing field is an error); anything else raises
ProtocolError naming the field (the server then closes that connection).

The data path encodes and decodes these frames natively (native/src/tcp/wire.cpp, the same checks; fuzzed
against this module in tests/transfer/test_native_tcp.py). Python uses this module for control requests and
their responses, refusals, and as the specification.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Annotated, Literal, Union

import msgpack
import msgspec
from msgspec import Meta

from kvplugins.errors import ProtocolError

VERSION = 1
MAGIC = b"KVPT"
PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 256 << 10
MAX_ENTRIES = 4096
MAX_STATUS = 4096  # characters of one entry's error text in a response
OP_WRITE, OP_READ, OP_RESP, OP_CONTROL = 1, 2, 3, 4
MAX_CONTROL_FIELDS, MAX_CONTROL_LIST = 32, 64
LATE_WRITE = "late write: "  # the start of each entry's status of a write frame that arrived after its "dl"
_U32, _U63 = (1 << 32) - 1, (1 << 63) - 1


@dataclass(frozen=True)
class Request:
    """A decoded request: ``entries`` is a tuple of (region_id, offset, length); ``control`` the body of an
    OP_CONTROL request (then entries is empty)."""

    op: int
    req_id: int
    entries: tuple[tuple[int, int, int], ...]
    control: dict | None = None
    land_by_ms: int = 0


def payload_limit(max_frame: int) -> int:
    """Largest payload one frame may carry under ``max_frame``."""
    return max_frame - MAX_HEADER


def encode_request(op: int, req_id: int, entries: list[tuple[int, int, int]], land_by_ms: int = 0) -> bytes:
    """Prefix + header of a request frame (the caller sends the write payload after it); "dl" when
    ``land_by_ms``."""
    payload = sum(e[2] for e in entries) if op == OP_WRITE else 0
    head = {"v": VERSION, "op": op, "id": req_id, "e": [list(e) for e in entries]}
    if land_by_ms:
        head["dl"] = land_by_ms
    return _frame(head, payload)


def encode_control(req_id: int, body: dict) -> bytes:
    """A whole control request frame (``body`` holds "kind" and the handler's fields)."""
    return _frame({"v": VERSION, "op": OP_CONTROL, "id": req_id, "c": body}, 0)


def encode_response(req_id: int, status: list[str | None], payload_len: int, control: dict | None = None) -> bytes:
    """Prefix + header of a response frame (the caller sends the read payload after it); ``control``: the
    reply body of a control request."""
    head = {"v": VERSION, "op": OP_RESP, "id": req_id, "st": status}
    if control is not None:
        head["c"] = control
    return _frame(head, payload_len)


def _frame(header: dict, payload_len: int) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(MAGIC, len(body), payload_len) + body


def parse_prefix(prefix: bytes | memoryview, max_frame: int) -> tuple[int, int]:
    """(header_len, payload_len) of a 16-byte prefix. Raises ProtocolError on bad magic or sizes."""
    magic, hlen, plen = PREFIX.unpack(prefix)
    if magic != MAGIC:
        hint = (
            " (an authentication handshake: the peer has a shared secret, this process has none)"
            if magic == b"KVPA"
            else ""
        )
        raise ProtocolError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}){hint}")
    if not 0 < hlen <= MAX_HEADER:
        raise ProtocolError(f"header length {hlen} outside 1..{MAX_HEADER}")
    if hlen + plen > max_frame:
        raise ProtocolError(f"frame of {hlen + plen} bytes exceeds max_frame {max_frame}")
    return hlen, plen


_Entries = Annotated[
    list[
        tuple[
            Annotated[int, Meta(ge=0, le=_U32)],
            Annotated[int, Meta(ge=0, le=_U63)],
            Annotated[int, Meta(ge=0, le=_U63)],
        ]
    ],
    Meta(min_length=1, max_length=MAX_ENTRIES),
]
_Scalar = Union[Annotated[str, Meta(max_length=256)], int, float, bool, None]
_Control = Annotated[
    dict[
        Annotated[str, Meta(max_length=32)], Union[_Scalar, Annotated[list[_Scalar], Meta(max_length=MAX_CONTROL_LIST)]]
    ],
    Meta(max_length=MAX_CONTROL_FIELDS),
]
# a reply may also carry text up to the header's size (e.g. a peer's segment as JSON: kvplugins/mooncake/te_peers.py);
# it comes from the server this process asked, over an authenticated connection, and is bounded by MAX_HEADER
_ReplyScalar = Union[Annotated[str, Meta(max_length=MAX_HEADER)], int, float, bool, None]
_Reply = Annotated[
    dict[
        Annotated[str, Meta(max_length=32)],
        Union[_ReplyScalar, Annotated[list[_Scalar], Meta(max_length=MAX_CONTROL_LIST)]],
    ],
    Meta(max_length=MAX_CONTROL_FIELDS),
]


class _RequestHeader(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    op: Annotated[int, Meta(ge=OP_WRITE, le=OP_READ)]
    id: Annotated[int, Meta(ge=0, le=_U63)]
    e: _Entries
    dl: Annotated[int, Meta(ge=0, le=_U63)] = 0


class _ControlHeader(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    op: Literal[4]
    id: Annotated[int, Meta(ge=0, le=_U63)]
    c: _Control


class _ResponseHeader(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    op: int
    id: int
    st: list[Union[Annotated[str, Meta(max_length=MAX_STATUS)], None]]
    c: Union[_Reply, None] = None


_REQUEST = msgspec.msgpack.Decoder(_RequestHeader)
_CONTROL = msgspec.msgpack.Decoder(_ControlHeader)
_RESPONSE = msgspec.msgpack.Decoder(_ResponseHeader)


def _decode(decoder, header: bytes | memoryview, what: str):
    """Typed decode of a header (msgspec: one pass, every field type- and range-checked). Raises ProtocolError
    naming the field."""
    try:
        obj = decoder.decode(header)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:  # (bad UTF-8 key; ~1000-deep nesting)
        raise ProtocolError(f"malformed {what} header: {e}") from None
    if obj.v != VERSION:
        raise ProtocolError(f"unknown wire version {obj.v!r} (this build speaks {VERSION})")
    return obj


def decode_request(header: bytes | memoryview, payload_len: int, max_frame: int) -> Request:
    """Validate and decode a request header. Raises ProtocolError."""
    try:
        obj = _decode(_REQUEST, header, "request")
    except ProtocolError as e:  # op 4 fails the data request's `op` range: a control request, or bad
        if "at `$.op`" not in str(e):
            raise
        try:
            obj = _decode(_CONTROL, header, "control request")
        except ProtocolError:
            raise e from None
    if isinstance(obj, _ControlHeader):
        if payload_len:
            raise ProtocolError(f"a control request carries no payload, got {payload_len} bytes")
        if not isinstance(obj.c.get("kind"), str):
            raise ProtocolError("a control request needs a string 'kind'")
        return Request(OP_CONTROL, obj.id, (), obj.c)
    op = obj.op
    entries = tuple(obj.e)
    total = sum(e[2] for e in entries)
    want = total if op == OP_WRITE else 0
    if payload_len != want:
        raise ProtocolError(f"payload of {payload_len} bytes, entries need {want}")
    if op == OP_READ and total > payload_limit(max_frame):
        raise ProtocolError(f"read of {total} bytes exceeds the frame limit {payload_limit(max_frame)}")
    return Request(op, obj.id, entries, land_by_ms=obj.dl)


def decode_response(header: bytes | memoryview, req_id: int, n_entries: int) -> list[str | None]:
    """Validate a response header for request ``req_id`` of ``n_entries``; returns per-entry status
    (None = ok, else the server's error text). Raises ProtocolError."""
    return _response(header, req_id, n_entries).st


def decode_control_response(header: bytes | memoryview, req_id: int) -> tuple[str | None, dict]:
    """(error text or None, reply body) of the response to control request ``req_id``. Raises ProtocolError."""
    obj = _response(header, req_id, 1)
    return obj.st[0], obj.c or {}


def _response(header, req_id: int, n_entries: int) -> _ResponseHeader:
    obj = _decode(_RESPONSE, header, "response")
    if obj.op != OP_RESP or obj.id != req_id:
        raise ProtocolError(f"expected response to request {req_id}, got op={obj.op!r} id={obj.id!r}")
    if len(obj.st) != n_entries:
        raise ProtocolError(f"status has {len(obj.st)} items for {n_entries} entries")
    return obj
