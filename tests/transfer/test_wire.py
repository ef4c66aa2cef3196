"""The wire decoder: exact round trips, each validation rule, and hypothesis fuzz of decode functions."""

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from kvplugins.errors import ProtocolError
from kvplugins.transfer import wire

MAX_FRAME = 16 << 20


def split(frame: bytes):
    hlen, plen = wire.parse_prefix(frame[: wire.PREFIX.size], MAX_FRAME)
    return frame[wire.PREFIX.size : wire.PREFIX.size + hlen], plen


def test_request_round_trip():
    entries = [(1, 0, 10), (7, 2**40, 5)]
    header, plen = split(wire.encode_request(wire.OP_WRITE, 99, entries))
    assert plen == 15
    assert wire.decode_request(header, plen, MAX_FRAME) == wire.Request(wire.OP_WRITE, 99, tuple(entries))


def test_response_round_trip():
    header, plen = split(wire.encode_response(5, [None, "region 3 is not exported"], 77))
    assert plen == 77
    assert wire.decode_response(header, 5, 2) == [None, "region 3 is not exported"]


def _hdr(**over):
    h = {"v": 1, "op": 1, "id": 1, "e": [[1, 0, 8]]}
    h.update(over)
    return msgpack.packb({k: v for k, v in h.items() if v is not ...})


@pytest.mark.parametrize(
    "header, plen, match",
    [
        (_hdr(v=2), 8, "unknown wire version 2"),
        (_hdr(v=True), 8, r"Expected `int`, got `bool` - at `\$.v`"),
        (_hdr(op=3), 8, r"Expected `int` <= 2 - at `\$.op`"),
        (_hdr(id=-1), 8, r"Expected `int` >= 0 - at `\$.id`"),
        (_hdr(e=...), 8, "missing required field `e`"),
        (_hdr(extra=1), 8, "unknown field `extra`"),
        (_hdr(e=[[1, -5, 8]]), 8, r"at `\$.e\[0\]\[1\]`"),
        (_hdr(e=[[1, 0, True]]), 1, r"got `bool` - at `\$.e\[0\]\[2\]`"),
        (_hdr(e=[[1, 0]]), 8, r"`array` of length 3, got 2 - at `\$.e\[0\]`"),
        (_hdr(e=[]), 0, r"length >= 1 - at `\$.e`"),
        (_hdr(e=[[1, 0, 1]] * (wire.MAX_ENTRIES + 1)), wire.MAX_ENTRIES + 1, r"length <= 4096 - at `\$.e`"),
        (_hdr(), 9, "payload of 9 bytes"),
        (_hdr(op=2), 8, "payload of 8 bytes"),
        (_hdr(op=2, e=[[1, 0, MAX_FRAME]]), 0, "exceeds the frame limit"),
        (msgpack.packb([1, 2]), 0, "Expected `object`, got `array`"),
        (b"\xc1", 0, "MessagePack data is malformed"),
        (msgpack.packb({"v": 1}) + b"x", 0, "malformed request header"),
    ],
)
def test_request_rejections(header, plen, match):
    with pytest.raises(ProtocolError, match=match):
        wire.decode_request(header, plen, MAX_FRAME)


@pytest.mark.parametrize(
    "prefix, match",
    [
        (wire.PREFIX.pack(b"XXXX", 10, 0), "magic"),
        (wire.PREFIX.pack(wire.MAGIC, 0, 0), "header length 0"),
        (wire.PREFIX.pack(wire.MAGIC, wire.MAX_HEADER + 1, 0), "header length"),
        (wire.PREFIX.pack(wire.MAGIC, 100, MAX_FRAME), "exceeds max_frame"),
    ],
)
def test_prefix_rejections(prefix, match):
    with pytest.raises(ProtocolError, match=match):
        wire.parse_prefix(prefix, MAX_FRAME)


def test_response_must_match_request():
    header, _ = split(wire.encode_response(5, [None], 0))
    with pytest.raises(ProtocolError, match="request 6"):
        wire.decode_response(header, 6, 1)
    with pytest.raises(ProtocolError, match="status has 1 items for 2 entries"):
        wire.decode_response(header, 5, 2)


def _valid(req: wire.Request) -> bool:
    return (
        req.op in (wire.OP_WRITE, wire.OP_READ)
        and 0 < len(req.entries) <= wire.MAX_ENTRIES
        and all(type(x) is int and x >= 0 for e in req.entries for x in e)
    )


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 2**20))
def test_fuzz_decode_random_bytes(data, plen):
    try:
        assert _valid(wire.decode_request(data, plen, MAX_FRAME))
    except ProtocolError:
        pass


_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=5), st.binary(max_size=5)
)
_tree = st.recursive(
    _leaf,
    lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(st.sampled_from(["v", "op", "id", "e", "st", "x"]), c, max_size=5)
    ),
    max_leaves=20,
)
_near_valid = st.fixed_dictionaries(
    {
        "v": st.one_of(st.just(1), _leaf),
        "op": st.one_of(st.sampled_from([1, 2, 3]), _leaf),
        "id": st.one_of(st.integers(0, 10), _leaf),
        "e": st.one_of(st.lists(st.lists(st.one_of(st.integers(-1, 2**64 - 1), _leaf), max_size=4), max_size=4), _tree),
    }
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_tree, _near_valid), st.integers(0, 100))
def test_fuzz_decode_random_headers(obj, plen):
    data = msgpack.packb(obj)
    for decode in (lambda: wire.decode_request(data, plen, MAX_FRAME), lambda: wire.decode_response(data, 1, 1)):
        try:
            out = decode()
        except ProtocolError:
            continue
        if isinstance(out, wire.Request):
            assert _valid(out)
        else:
            assert len(out) == 1 and (out[0] is None or isinstance(out[0], str))


def test_control_request_and_reply_round_trip():
    """A control request (the RDMA transport's QP exchange) decodes to its body; its reply carries one status."""
    body = {"kind": "rdma", "qpn": 17, "gid": "0000:0000:0000:0000:0000:ffff:0a4d:000f", "nics": [1, "x"]}
    frame = wire.encode_control(9, body)
    hlen, plen = wire.parse_prefix(frame[: wire.PREFIX.size], MAX_FRAME)
    req = wire.decode_request(frame[wire.PREFIX.size :], plen, MAX_FRAME)
    assert (req.op, req.req_id, req.entries, req.control) == (wire.OP_CONTROL, 9, (), body)
    reply = wire.encode_response(9, [None], 0, {"qpn": 18})
    assert wire.decode_control_response(reply[wire.PREFIX.size :], 9) == (None, {"qpn": 18})
    refused = wire.encode_response(9, ["no 'rdma' control here"], 0)
    assert wire.decode_control_response(refused[wire.PREFIX.size :], 9) == ("no 'rdma' control here", {})


@pytest.mark.parametrize(
    "header, plen, match",
    [
        (msgpack.packb({"v": 1, "op": 4, "id": 1, "c": {"kind": "rdma"}}), 3, "control request carries no payload"),
        (msgpack.packb({"v": 1, "op": 4, "id": 1, "c": {"qpn": 1}}), 0, "needs a string 'kind'"),
        (msgpack.packb({"v": 1, "op": 4, "id": 1, "c": {"kind": "rdma", "x": {"nested": 1}}}), 0, r"at `\$.op`"),
        (msgpack.packb({"v": 1, "op": 4, "id": 1, "c": {f"k{i}": 1 for i in range(40)}}), 0, r"at `\$.op`"),
        (msgpack.packb({"v": 1, "op": 5, "id": 1, "c": {"kind": "rdma"}}), 0, r"<= 2 - at `\$.op`"),
    ],
)
def test_control_request_rejections(header, plen, match):
    """A malformed control request is refused whole (the data request's error names `op`, the field that
    neither form accepts)."""
    with pytest.raises(ProtocolError, match=match):
        wire.decode_request(header, plen, MAX_FRAME)
