"""The transfer wire's typed headers (#11), one field at a time: every field of a request and of a response
header gets a wrong type, a negative, zero, a huge value, an over-long string, bytes or list, deep nesting, or
goes missing, or an extra field joins; an oracle says whether that is still valid (then the decode must equal
it) or which field the ProtocolError must name. Plus: the encoders' bytes are unchanged (the pre-#11 frame)."""

from __future__ import annotations

import re

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from kvplugins.errors import ProtocolError
from kvplugins.transfer import wire

MAX_FRAME = 16 << 20
LIMIT = wire.payload_limit(MAX_FRAME)
U32, U63, U64 = (1 << 32) - 1, (1 << 63) - 1, (1 << 64) - 1
SETTINGS = settings(max_examples=300, deadline=None)


class Raw(bytes):
    """A value already in msgpack (deep nesting: msgpack's packer refuses past 512 levels)."""

    def __repr__(self) -> str:
        return f"Raw({len(self)} bytes)"


DEEP = Raw(b"\x91" * 3000 + b"\x01")


def pack(value) -> bytes:
    return bytes(value) if isinstance(value, Raw) else msgpack.packb(value, use_bin_type=True)


def packed_map(fields: dict) -> bytes:
    """A msgpack map of ``fields`` (at most 15) whose values may be Raw."""
    return bytes([0x80 | len(fields)]) + b"".join(pack(k) + pack(v) for k, v in fields.items())


hostile = st.one_of(
    st.sampled_from(["1", 1.5, True, False, None, b"\x01", [1], {"a": 1}]),  # wrong type
    st.integers(-(1 << 63), -1),  # negative
    st.just(0),  # zero
    st.sampled_from([U32 + 1, U63, U63 + 1, U64]) | st.integers(U32 + 1, U64),  # huge
    st.sampled_from(["x" * 5000, b"x" * 5000, [0] * 5000, [[1, 0, 1]] * (wire.MAX_ENTRIES + 1)]),  # over-long
    st.just(DEEP),  # deep nesting
)


def is_int(v) -> bool:
    return type(v) is int


# ---- request headers -----------------------------------------------------------------------------------------
entry = st.tuples(st.integers(0, U32), st.integers(0, 1 << 20), st.integers(0, 1 << 16))
valid_request = st.fixed_dictionaries(
    {
        "v": st.just(1),
        "op": st.sampled_from([wire.OP_WRITE, wire.OP_READ]),
        "id": st.integers(0, U63),
        "e": st.lists(entry, min_size=1, max_size=8),
    }
)


def request_oracle(h: dict):
    """(expected Request, payload_len) if ``h`` is a valid request header, else (regex the error must match,
    payload_len). One field differs from a valid header at most."""
    for name in ("v", "op", "id", "e"):
        if name not in h:
            return rf"missing required field `{name}`", 0
    extra = [k for k in h if k not in ("v", "op", "id", "e")]
    if extra:
        return rf"unknown field `{re.escape(str(extra[0]))}`", 0
    v, op, rid, e = h["v"], h["op"], h["id"], h["e"]
    if not is_int(v):
        return r"at `\$\.v`", 0
    if not (is_int(op) and op in (wire.OP_WRITE, wire.OP_READ)):
        return r"at `\$\.op`", 0
    if not (is_int(rid) and 0 <= rid <= U63):
        return r"at `\$\.id`", 0
    bad = _bad_entries(e)
    if bad:
        return bad, 0
    if v != wire.VERSION:
        return "unknown wire version", 0
    total = sum(x[2] for x in e)
    if op == wire.OP_READ and total > LIMIT:
        return "exceeds the frame limit", 0
    return wire.Request(op, rid, tuple(tuple(x) for x in e)), total if op == wire.OP_WRITE else 0


def _bad_entries(e) -> str | None:
    """Regex of the error for entries ``e``, None if they are valid."""
    if isinstance(e, Raw):  # nested one-item arrays: refused at the first item
        return r"at `\$\.e\[0\]`"
    if not isinstance(e, (list, tuple)) or not 1 <= len(e) <= wire.MAX_ENTRIES:
        return r"at `\$\.e`"
    for i, x in enumerate(e):
        if isinstance(x, Raw) or not isinstance(x, (list, tuple)) or len(x) != 3:
            return rf"at `\$\.e\[{i}\]"
        for j, (n, top) in enumerate(zip(x, (U32, U63, U63))):
            if not (is_int(n) and 0 <= n <= top):
                return rf"at `\$\.e\[{i}\]\[{j}\]`"
    return None


def check_request(h: dict) -> None:
    want, plen = request_oracle(h)
    header = packed_map(h)
    if isinstance(want, wire.Request):
        assert wire.decode_request(header, plen, MAX_FRAME) == want
    else:
        with pytest.raises(ProtocolError, match=want):
            wire.decode_request(header, plen, MAX_FRAME)


@SETTINGS
@given(valid_request, st.sampled_from(["v", "op", "id", "e"]), hostile)
def test_request_field_replaced(h, name, value):
    check_request({**h, name: value})


@SETTINGS
@given(valid_request, st.data(), hostile)
def test_request_entry_item_replaced(h, data, value):
    i = data.draw(st.integers(0, len(h["e"]) - 1))
    j = data.draw(st.integers(0, 2))
    e = [list(x) for x in h["e"]]
    e[i][j] = value
    check_request({**h, "e": e})


@SETTINGS
@given(valid_request, st.sampled_from(["v", "op", "id", "e"]))
def test_request_field_missing(h, name):
    del h[name]
    check_request(h)


@SETTINGS
@given(valid_request, st.text(min_size=1, max_size=300).filter(lambda k: k not in ("v", "op", "id", "e")), hostile)
def test_request_extra_field(h, name, value):
    check_request({**h, name: value})


@SETTINGS
@given(valid_request, st.integers(0, 1 << 20))
def test_request_payload_must_match_entries(h, plen):
    want, need = request_oracle(h)
    if plen == need:
        assert wire.decode_request(packed_map(h), plen, MAX_FRAME) == want
    else:
        with pytest.raises(ProtocolError, match=f"payload of {plen} bytes, entries need {need}"):
            wire.decode_request(packed_map(h), plen, MAX_FRAME)


def test_request_over_long_entry_lists_and_deep_nesting():
    e = [[1, 0, 0]] * (wire.MAX_ENTRIES + 1)
    with pytest.raises(ProtocolError, match=rf"length <= {wire.MAX_ENTRIES} - at `\$\.e`"):
        wire.decode_request(packed_map({"v": 1, "op": 2, "id": 1, "e": e}), 0, MAX_FRAME)
    for field in ("v", "op", "id", "e", "x"):
        with pytest.raises(ProtocolError, match=field):
            wire.decode_request(packed_map({"v": 1, "op": 2, "id": 1, "e": [[1, 0, 1]], field: DEEP}), 0, MAX_FRAME)


# ---- response headers ----------------------------------------------------------------------------------------
status = st.one_of(st.none(), st.text(max_size=50))
valid_response = st.fixed_dictionaries(
    {
        "v": st.just(1),
        "op": st.just(wire.OP_RESP),
        "id": st.integers(0, U63),
        "st": st.lists(status, min_size=0, max_size=8),
    }
)


def response_oracle(h: dict, req_id: int, n: int):
    """The expected status list, or the regex the ProtocolError must match."""
    for name in ("v", "op", "id", "st"):
        if name not in h:
            return rf"missing required field `{name}`"
    extra = [k for k in h if k not in ("v", "op", "id", "st")]
    if extra:
        return rf"unknown field `{re.escape(str(extra[0]))}`"
    for name in ("v", "op", "id"):
        if not (is_int(h[name]) and -(1 << 63) <= h[name] <= U64):
            return rf"at `\$\.{name}`"
    s = h["st"]
    if isinstance(s, Raw):
        return r"at `\$\.st\[0\]`"
    if not isinstance(s, list):
        return r"at `\$\.st`"
    for i, x in enumerate(s):
        if not (x is None or (isinstance(x, str) and len(x) <= wire.MAX_STATUS)):
            return rf"at `\$\.st\[{i}\]`"
    if h["v"] != wire.VERSION:
        return "unknown wire version"
    if h["op"] != wire.OP_RESP or h["id"] != req_id:
        return f"expected response to request {req_id}"
    if len(s) != n:
        return f"status has {len(s)} items for {n} entries"
    return s


def check_response(h: dict, req_id: int, n: int) -> None:
    want = response_oracle(h, req_id, n)
    if isinstance(want, list):
        assert wire.decode_response(packed_map(h), req_id, n) == want
    else:
        with pytest.raises(ProtocolError, match=want):
            wire.decode_response(packed_map(h), req_id, n)


@SETTINGS
@given(valid_response, st.sampled_from(["v", "op", "id", "st"]), hostile)
def test_response_field_replaced(h, name, value):
    check_response({**h, name: value}, h["id"], len(h["st"]))


@SETTINGS
@given(valid_response.filter(lambda h: h["st"]), st.data(), hostile | st.text(min_size=4000, max_size=4200))
def test_response_status_item_replaced(h, data, value):
    i = data.draw(st.integers(0, len(h["st"]) - 1))
    s = list(h["st"])
    s[i] = value
    check_response({**h, "st": s}, h["id"], len(s))


@SETTINGS
@given(valid_response, st.sampled_from(["v", "op", "id", "st"]))
def test_response_field_missing(h, name):
    n = len(h["st"])
    del h[name]
    check_response(h, h.get("id", 0), n)


@SETTINGS
@given(
    valid_response, st.text(min_size=1, max_size=300).filter(lambda k: k not in ("v", "op", "id", "st", "c")), hostile
)
def test_response_extra_field(h, name, value):
    check_response({**h, name: value}, h["id"], len(h["st"]))


@SETTINGS
@given(valid_response, st.integers(0, U63), st.integers(0, 10))
def test_response_must_answer_this_request(h, req_id, n):
    check_response(h, req_id, n)


# ---- prefix and the unchanged encoders -----------------------------------------------------------------------
@SETTINGS
@given(st.one_of(st.just(wire.MAGIC), st.binary(min_size=4, max_size=4)), st.integers(0, U32), st.integers(0, U64))
def test_prefix(magic, hlen, plen):
    prefix = wire.PREFIX.pack(magic, hlen, plen)
    if magic != wire.MAGIC:
        match = "bad frame magic"
    elif not 0 < hlen <= wire.MAX_HEADER:
        match = f"header length {hlen} outside"
    elif hlen + plen > MAX_FRAME:
        match = "exceeds max_frame"
    else:
        assert wire.parse_prefix(prefix, MAX_FRAME) == (hlen, plen)
        return
    with pytest.raises(ProtocolError, match=match):
        wire.parse_prefix(prefix, MAX_FRAME)


@SETTINGS
@given(valid_request)
def test_request_frames_are_byte_identical_to_the_v1_encoding(h):
    plen = sum(x[2] for x in h["e"]) if h["op"] == wire.OP_WRITE else 0
    body = msgpack.packb({"v": 1, "op": h["op"], "id": h["id"], "e": [list(x) for x in h["e"]]}, use_bin_type=True)
    frame = wire.encode_request(h["op"], h["id"], h["e"])
    assert frame == wire.PREFIX.pack(wire.MAGIC, len(body), plen) + body
    assert wire.decode_request(frame[wire.PREFIX.size :], plen, MAX_FRAME) == request_oracle(h)[0]


@SETTINGS
@given(valid_response, st.integers(0, 1 << 20))
def test_response_frames_are_byte_identical_to_the_v1_encoding(h, plen):
    body = msgpack.packb({"v": 1, "op": wire.OP_RESP, "id": h["id"], "st": h["st"]}, use_bin_type=True)
    frame = wire.encode_response(h["id"], h["st"], plen)
    assert frame == wire.PREFIX.pack(wire.MAGIC, len(body), plen) + body
    assert wire.decode_response(frame[wire.PREFIX.size :], h["id"], len(h["st"])) == h["st"]
