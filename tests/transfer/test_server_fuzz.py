"""Garbage on the wire never crashes the TCP server: each bad connection is closed (reason logged), and
the server keeps serving a good client. The server runs in a real peer process (port 0)."""

import logging
import socket

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers.auth import authenticated
from helpers.peer import Peer
from kvplugins.transfer import TransferConfig, TransferEngine, TransferRequest, wire

SIZE = 1 << 16


@pytest.fixture(scope="module")
def peer():
    with Peer(transports="tcp", size=SIZE, seed=9) as p:
        yield p


@pytest.fixture(scope="module")
def client():
    eng = TransferEngine(TransferConfig(transports="tcp", timeout_ms=3000))
    yield eng
    eng.close()


def _send_raw(port: int, data: bytes) -> bytes:
    """Send ``data``, half-close, and return whatever the server answers before it closes."""
    with authenticated(socket.create_connection(("127.0.0.1", port), timeout=5), "data") as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except OSError:  # the server closed first (reset, broken pipe, not connected)
            return b""
        return b"".join(chunks)


def _frame(header_obj, payload: bytes = b"", claim: int | None = None) -> bytes:
    body = msgpack.packb(header_obj)
    return wire.PREFIX.pack(wire.MAGIC, len(body), len(payload) if claim is None else claim) + body + payload


_ints = st.integers(-(2**63), 2**64 - 1)
_entry = st.lists(st.one_of(st.integers(0, 4), st.integers(0, SIZE * 2), _ints), min_size=0, max_size=4)
_header = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 2, "1"]), "op": st.integers(0, 4), "id": _ints, "e": st.lists(_entry, max_size=5)}
)
_garbage = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda h, b: wire.MAGIC + h + b, st.binary(min_size=12, max_size=12), st.binary(max_size=100)),
    st.builds(_frame, _header, st.binary(max_size=300)),
    st.builds(_frame, _header, st.binary(max_size=50), st.integers(0, 1 << 20)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_garbage)
def test_fuzzed_frames_never_stop_the_server(peer, client, data):
    _send_raw(peer.descriptor.transports["tcp"]["port"], data)
    assert peer.proc.is_alive()
    dst = client.register(bytearray(64))
    try:
        req = TransferRequest(dst, 0, peer.descriptor, peer.region_id, SIZE - 64, 64)
        assert client.batch_read([req]) == [None]
    finally:
        client.unregister(dst)


def test_good_client_still_reads_exact_bytes_after_fuzz(peer, client):
    dst = np.zeros(100, dtype=np.uint8)
    region = client.register(dst)
    # bytes [0, 100) may have been overwritten by fuzzed writes; the tail is read-only in the fuzz
    req = TransferRequest(region, 0, peer.descriptor, peer.region_id, SIZE - 100, 100)
    assert client.batch_read([req]) == [None]
    assert peer.read(SIZE - 100, 100) == dst.tobytes()


def test_bad_version_closes_connection_with_logged_reason(caplog):
    caplog.set_level(logging.WARNING, logger="kvplugins.transfer")
    with TransferEngine(TransferConfig(transports="tcp")) as server:
        region = server.alloc_shared(4096)
        port = server.descriptor().transports["tcp"]["port"]
        bad = _frame({"v": 7, "op": 2, "id": 1, "e": [[region.region_id, 0, 8]]})
        assert _send_raw(port, bad) == b""
        good = _frame({"v": 1, "op": 2, "id": 2, "e": [[region.region_id, 0, 8]]})
        answer = _send_raw(port, good)
    assert "unknown wire version 7" in caplog.text
    hlen, plen = wire.parse_prefix(answer[: wire.PREFIX.size], 1 << 24)
    assert wire.decode_response(answer[wire.PREFIX.size : wire.PREFIX.size + hlen], 2, 1) == [None]
    assert plen == 8 and answer[-8:] == bytes(8)
