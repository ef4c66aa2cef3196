"""The native TCP data path (native/src/tcp/, issue #13): serving without the GIL, the native request decoder
under fuzzing (never a crash; it agrees with the wire specification's decoder, kvplugins/transfer/wire.py),
and the client's multi-connection batches against a real peer process."""

import socket
import subprocess
import sys
import struct
import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers.peer import Peer, digest, seeded
from kvplugins.errors import ProtocolError
from kvplugins.transfer import TransferConfig, TransferEngine, native_tcp, wire

MAX_FRAME = 16 << 20
SIZE = 8 << 20


def test_server_keeps_serving_while_python_holds_the_gil():
    """The peer's main thread spins holding its GIL for 6 s (switch interval raised past the spin): reads and
    writes over connections it had accepted still complete, with the right bytes, long before the spin ends.
    (A new connection waits for the accept and handshake, which are Python: it is served after the spin.)"""
    with (
        Peer(transports="tcp", size=SIZE, seed=5) as peer,
        TransferEngine(TransferConfig(transports="tcp", tcp_connections=4, timeout_ms=4000)) as eng,
    ):
        buf = np.zeros(SIZE, dtype=np.uint8)
        a = eng.register(buf).addr
        assert eng.read_spans(peer.descriptor, peer.region_id, [a], [0], [SIZE]) == [None]  # 4 pooled conns
        assert digest(buf) == digest(seeded(SIZE, 5))
        peer.spin(6.0)
        time.sleep(0.5)  # the spin has begun
        t0 = time.monotonic()
        buf[:] = 0x3C
        assert eng.write_spans(peer.descriptor, peer.region_id, [a], [0], [SIZE]) == [None]
        buf[:] = 0
        assert eng.read_spans(peer.descriptor, peer.region_id, [a], [0], [SIZE]) == [None]
        elapsed = time.monotonic() - t0
        assert (buf == 0x3C).all()
        assert elapsed < 3.0, f"served in {elapsed:.2f} s while the peer's Python was busy"
        assert peer.wait_spun(30)
        assert peer.digest(0, SIZE) == digest(buf)


_u = st.integers(0, (1 << 64) - 1)
_entry = st.lists(st.one_of(_u, st.integers(0, 1 << 33), st.none(), st.text(max_size=3)), min_size=0, max_size=4)
_value = st.one_of(
    _u,
    st.integers(-5, 5),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.floats(),
    st.lists(_entry, max_size=5),
    st.binary(max_size=4),
)
_header = st.dictionaries(st.sampled_from(["v", "op", "id", "e", "dl", "x", "st"]), _value, max_size=7)
_good = st.fixed_dictionaries(
    {
        "v": st.just(1),
        "op": st.sampled_from([1, 2]),
        "id": st.integers(0, (1 << 63) - 1),
        "e": st.lists(
            st.tuples(st.integers(0, (1 << 32) - 1), st.integers(0, 1 << 40), st.integers(0, 1 << 20)),
            min_size=1,
            max_size=20,
        ),
    },
    optional={"dl": st.integers(0, (1 << 63) - 1)},
)


def _python(header: bytes, plen: int):
    try:
        return wire.decode_request(header, plen, MAX_FRAME)
    except ProtocolError:
        return None


def _native(header: bytes, plen: int):
    try:
        kind, op, req_id, entries, land_by = native_tcp.decode_request(header, plen, MAX_FRAME)
    except ProtocolError as e:
        assert str(e)  # a reason, for the log line
        return None
    return kind if kind == "control" else wire.Request(op, req_id, tuple(entries), land_by_ms=land_by)


def _agree(header: bytes, plen: int) -> None:
    py, nat = _python(header, plen), _native(header, plen)
    if nat == "control":  # handed to Python, which decides
        return
    assert nat == py, (header, plen, nat, py)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=200), plen=st.integers(0, 1 << 30))
def test_native_decoder_survives_garbage(data, plen):
    _agree(data, plen)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=_header, plen=st.integers(0, 1 << 21))
def test_native_decoder_agrees_with_the_wire_spec(h, plen):
    _agree(msgpack.packb(h, use_bin_type=True), plen)


@settings(max_examples=500, deadline=None)
@given(h=_good)
def test_native_decoder_accepts_every_valid_request(h):
    entries = [list(e) for e in h["e"]]
    plen = sum(e[2] for e in entries) if h["op"] == 1 else 0
    header = msgpack.packb({**h, "e": entries}, use_bin_type=True)
    want = wire.Request(h["op"], h["id"], tuple(map(tuple, entries)), land_by_ms=h.get("dl", 0))
    assert _native(header, plen) == want == _python(header, plen)
    _agree(header, plen + 1)  # a payload the entries do not account for: refused by both


def test_native_decoder_names_the_field():
    bad = msgpack.packb({"v": 1, "op": 2, "id": 1, "e": [[1, -1, 8]]})
    with pytest.raises(ProtocolError, match=r"\$\.e\[0\]\[1\]"):
        native_tcp.decode_request(bad, 0, MAX_FRAME)
    # entries are read without their names and a failing one read again with them: the right one is named
    for e, where in (
        ([[1, 0, 8], [2, 0, 8], [3, 8]], r"length 3 - at `\$\.e\[2\]`"),
        ([[1, 0, 8], [2, 0, 8], [1 << 32, 0, 8]], r"out of range - at `\$\.e\[2\]\[0\]`"),
        ([[1, 0, 8], [2, 0, "x"]], r"`\$\.e\[1\]\[2\]`"),
    ):
        with pytest.raises(ProtocolError, match=where):
            native_tcp.decode_request(msgpack.packb({"v": 1, "op": 2, "id": 1, "e": e}), 0, MAX_FRAME)
    with pytest.raises(ProtocolError, match="unknown wire version 7"):
        native_tcp.decode_request(msgpack.packb({"v": 7, "op": 2, "id": 1, "e": [[1, 0, 8]]}), 0, MAX_FRAME)


def test_loopback_baseline_moves_bytes():
    [t] = native_tcp.loopback_baseline(1 << 20, 1)
    assert 0 < t < 10


def test_server_survives_a_client_dying_mid_frame():
    """A client dies halfway through a write frame's header, and another halfway through its payload (closed
    with RST, as the kernel does for a killed process): the native server drops both connections, releases
    their admission, and keeps serving: a new client reads the region, byte for byte what it holds."""
    with TransferEngine(TransferConfig(transports="tcp")) as server:
        region = server.alloc_shared(1 << 20)
        server.memoryview(region)[:] = seeded(1 << 20, 9)
        tcp = next(t for t in server._transports if t.name == "tcp").server
        port = server.descriptor().transports["tcp"]["port"]
        frame = wire.encode_request(wire.OP_WRITE, 1, [(region.region_id, 0, 1 << 20)])
        for cut in (len(frame) // 2, len(frame) + (300 << 10)):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall((frame + bytes(1 << 20))[:cut])
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        deadline = time.monotonic() + 5
        while tcp.stats()["connections"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tcp.stats()["connections"] == 0, tcp.stats()
        with TransferEngine(TransferConfig(transports="tcp")) as reader:
            buf = np.zeros(1 << 20, dtype=np.uint8)
            a = reader.register(buf).addr
            assert reader.read_spans(server.descriptor(), region.region_id, [a], [0], [1 << 20]) == [None]
        assert digest(buf) == digest(server.memoryview(region))


def test_process_exits_cleanly_while_native_calls_are_in_flight():
    """Daemon threads blocked in a GIL-released native call (the TCP server's event wait) when the interpreter
    finalizes must not abort the process ("terminate called without an active exception", exit 134 after
    pytest had passed every test): a slow finalizer keeps finalization open while their waits return."""
    code = (
        "import time\nfrom kvplugins.transfer import TransferConfig, TransferEngine\n"
        "engines = [TransferEngine(TransferConfig(transports='tcp')) for _ in range(8)]\n"
        "class Slow:\n    def __del__(self):\n        time.sleep(1.2)\n"
        "slow = Slow()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr[-2000:]
