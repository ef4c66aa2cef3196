"""TCP wire format of the transfer core, version 1.

Frame = prefix (16 bytes, little-endian: magic b"KVPT", u32 header_len, u64 payload_len)
        + msgpack header (header_len bytes) + raw payload (payload_len bytes).
Request header:  {"v": 1, "op": 1 (write) | 2 (read), "id": u63, "e": [[region u32, offset u63, length u63], ...]}
                 a write's payload is the entries' bytes concatenated; a read's payload is empty.
Response header: {"v": 1, "op": 3, "id": same id, "st": [None | "error text", ...]} one status per entry;
                 a read response's payload is the bytes of the entries whose status is None, in order.
Limits: header_len <= MAX_HEADER, header_len + payload_len <= max_frame (config), at most MAX_ENTRIES
entries, and a read's total length <= max_frame - MAX_HEADER. Every field is type- and range-checked;
anything else raises ProtocolError (the server then closes that connection).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from kvplugins.errors import ProtocolError

VERSION = 1
MAGIC = b"KVPT"
PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 256 << 10
MAX_ENTRIES = 4096
OP_WRITE, OP_READ, OP_RESP = 1, 2, 3
_U32, _U63 = (1 << 32) - 1, (1 << 63) - 1


@dataclass(frozen=True)
class Request:
    """A decoded request: ``entries`` is a tuple of (region_id, offset, length)."""
    op: int
    req_id: int
    entries: tuple[tuple[int, int, int], ...]


def payload_limit(max_frame: int) -> int:
    """Largest payload one frame may carry under ``max_frame``."""
    return max_frame - MAX_HEADER


def encode_request(op: int, req_id: int, entries: list[tuple[int, int, int]]) -> bytes:
    """Prefix + header of a request frame (the caller sends the write payload after it)."""
    payload = sum(e[2] for e in entries) if op == OP_WRITE else 0
    return _frame({"v": VERSION, "op": op, "id": req_id, "e": [list(e) for e in entries]}, payload)


def encode_response(req_id: int, status: list[str | None], payload_len: int) -> bytes:
    """Prefix + header of a response frame (the caller sends the read payload after it)."""
    return _frame({"v": VERSION, "op": OP_RESP, "id": req_id, "st": status}, payload_len)


def _frame(header: dict, payload_len: int) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(MAGIC, len(body), payload_len) + body


def parse_prefix(prefix: bytes | memoryview, max_frame: int) -> tuple[int, int]:
    """(header_len, payload_len) of a 16-byte prefix. Raises ProtocolError on bad magic or sizes."""
    magic, hlen, plen = PREFIX.unpack(prefix)
    if magic != MAGIC:
        hint = " (an authentication handshake: the peer has a shared secret, this process has none)" \
            if magic == b"KVPA" else ""
        raise ProtocolError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}){hint}")
    if not 0 < hlen <= MAX_HEADER:
        raise ProtocolError(f"header length {hlen} outside 1..{MAX_HEADER}")
    if hlen + plen > max_frame:
        raise ProtocolError(f"frame of {hlen + plen} bytes exceeds max_frame {max_frame}")
    return hlen, plen


def _unpack(header: bytes | memoryview) -> dict:
    try:
        obj = msgpack.unpackb(header, raw=False, strict_map_key=True)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:  # the ways garbage fails
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"header is a {type(obj).__name__}, expected a map")
    if obj.get("v") != VERSION or type(obj.get("v")) is not int:
        raise ProtocolError(f"unknown wire version {obj.get('v')!r} (this build speaks {VERSION})")
    return obj


def _int(value, low: int, high: int, name: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"field {name}={value!r} is not an integer in {low}..{high}")
    return value


def _keys(obj: dict, keys: set[str]) -> None:
    if set(obj) != keys:
        raise ProtocolError(f"header keys {sorted(map(str, obj))} != expected {sorted(keys)}")


def decode_request(header: bytes | memoryview, payload_len: int, max_frame: int) -> Request:
    """Validate and decode a request header. Raises ProtocolError."""
    obj = _unpack(header)
    _keys(obj, {"v", "op", "id", "e"})
    op = _int(obj["op"], OP_WRITE, OP_READ, "op")
    req_id = _int(obj["id"], 0, _U63, "id")
    raw = obj["e"]
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_ENTRIES:
        raise ProtocolError(f"entries must be a list of 1..{MAX_ENTRIES} items")
    entries = tuple(_entry(e, i) for i, e in enumerate(raw))
    total = sum(e[2] for e in entries)
    want = total if op == OP_WRITE else 0
    if payload_len != want:
        raise ProtocolError(f"payload of {payload_len} bytes, entries need {want}")
    if op == OP_READ and total > payload_limit(max_frame):
        raise ProtocolError(f"read of {total} bytes exceeds the frame limit {payload_limit(max_frame)}")
    return Request(op, req_id, entries)


def _entry(e, i: int) -> tuple[int, int, int]:
    if not isinstance(e, list) or len(e) != 3:
        raise ProtocolError(f"entry {i} must be [region, offset, length]")
    return (_int(e[0], 0, _U32, f"e[{i}].region"), _int(e[1], 0, _U63, f"e[{i}].offset"),
            _int(e[2], 0, _U63, f"e[{i}].length"))


def decode_response(header: bytes | memoryview, req_id: int, n_entries: int) -> list[str | None]:
    """Validate a response header for request ``req_id`` of ``n_entries``; returns per-entry status
    (None = ok, else the server's error text). Raises ProtocolError."""
    obj = _unpack(header)
    _keys(obj, {"v", "op", "id", "st"})
    if obj["op"] != OP_RESP or obj["id"] != req_id:
        raise ProtocolError(f"expected response to request {req_id}, got op={obj['op']!r} id={obj['id']!r}")
    st = obj["st"]
    if not isinstance(st, list) or len(st) != n_entries or not all(s is None or isinstance(s, str) for s in st):
        raise ProtocolError(f"status must be a list of {n_entries} None/str items")
    return st
