"""The transfer TCP server degrades instead of dying (issue #11): a flood past its descriptor limit (EMFILE) leaves
an established client served and the server recovers; connection caps refuse with the reason, which the client
raises as TransferFailed; idle and slowloris connections are closed within their timeouts; a client whose pooled
connections the server closed for idleness reconnects without a failed transfer. The server runs in its own
process (tests/helpers/limited_server.py) on port 0; the client is a real TransferEngine over tcp."""

import socket
import time

import numpy as np
import pytest

from helpers.auth import authenticated
from helpers.limited_server import REGION_SIZE, SEED, LimitedServer, closed_within, flood
from helpers.peer import seeded
from kvplugins.config import load
from kvplugins.errors import ConfigError, TransferFailed
from kvplugins.transfer import SegmentDescriptor, TransferConfig, TransferEngine, TransferRequest, wire

EXPECTED = seeded(REGION_SIZE, SEED).tobytes()


@pytest.fixture
def engines():
    made = []

    def make(**kw):
        made.append(TransferEngine(TransferConfig(transports="tcp", timeout_ms=3000, **kw)))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _run(eng, srv, op: str, off: int, data: np.ndarray):
    """One batch of ``op`` ("read"/"write") of ``data``'s bytes at ``off`` of the server's region; its status."""
    desc = SegmentDescriptor.from_wire(srv.info["descriptor"])
    local = eng.register(data)
    try:
        req = TransferRequest(local, 0, desc, srv.info["region"], off, data.nbytes)
        return (eng.batch_read if op == "read" else eng.batch_write)([req])[0]
    finally:
        eng.unregister(local)


def _read_ok(eng, srv, off: int, n: int, expected: bytes | None = None) -> None:
    dst = np.zeros(n, dtype=np.uint8)
    status = _run(eng, srv, "read", off, dst)
    assert status is None, status
    assert dst.tobytes() == (EXPECTED[off : off + n] if expected is None else expected)


def _hold(port: int, source: str) -> socket.socket:
    """A connection from loopback address ``source`` (each 127.x is its own peer host) that sends nothing."""
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def test_limits_config_keys_validate_and_come_from_env():
    cfg = load(
        TransferConfig,
        environ={
            "KVPLUGINS_TRANSFER_MAX_CONNECTIONS": "7",
            "KVPLUGINS_TRANSFER_MAX_CONNECTIONS_PER_PEER": "3",
            "KVPLUGINS_TRANSFER_IDLE_TIMEOUT_MS": "1500",
        },
    )
    lim = cfg.server_limits()
    assert (lim.max_connections, lim.max_per_peer, lim.idle_timeout_s) == (7, 3, 1.5)
    assert lim.frame_timeout_s == 2 * cfg.timeout_ms / 1000  # frame_timeout_ms=0: twice the batch timeout
    assert TransferConfig(frame_timeout_ms=250).server_limits().frame_timeout_s == 0.25
    for bad in ({"max_connections": -1}, {"idle_timeout_ms": -5}, {"frame_timeout_ms": "x"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            TransferConfig(**bad)


@pytest.mark.timeout(120)
def test_descriptor_exhaustion_keeps_established_client_and_recovers(engines):
    with LimitedServer("transfer", nofile=64, config={"idle_timeout_ms": 60000}) as srv:
        eng = engines(tcp_connections=1)  # one pooled connection, established before the flood
        _read_ok(eng, srv, 100, 1000)
        socks = flood(srv.info["port"], 150)
        try:
            st = srv.wait_stats(lambda s: s["accept_failures"] > 0)
            assert st["accept_failures"] > 0, f"the flood of {len(socks)} connections did not exhaust 64 fds: {st}"
            for i in range(5):  # the established client is served during the flood
                _read_ok(eng, srv, 1000 * i, 4096)
            new = np.arange(4096, dtype=np.uint8)
            assert _run(eng, srv, "write", 8192, new) is None
            _read_ok(eng, srv, 8192, 4096, new.tobytes())
            assert srv.alive()
        finally:
            for s in socks:
                s.close()
        accepts = srv.log_lines("accept failed")
        assert any("accept failed (Too many open files)" in ln for ln in accepts), accepts
        ok, deadline = None, time.monotonic() + 30  # recovered: new clients are served again
        while ok is None and time.monotonic() < deadline:
            dst = np.zeros(2048, dtype=np.uint8)
            fresh = engines()
            if _run(fresh, srv, "read", REGION_SIZE - 2048, dst) is None:
                ok = dst.tobytes()
        assert ok == EXPECTED[-2048:]
        assert srv.alive()


@pytest.mark.timeout(120)
def test_global_and_per_peer_caps_refuse_with_the_reason(engines):
    with LimitedServer("transfer", config={"max_connections": 3, "max_connections_per_peer": 2}) as srv:
        port = srv.info["port"]
        eng = engines()
        held = [_hold(port, "127.0.0.1"), _hold(port, "127.0.0.2"), _hold(port, "127.0.0.2")]
        assert srv.wait_stats(lambda s: s["connections"] == 3)["connections"] == 3
        status = _run(eng, srv, "read", 0, np.zeros(64, dtype=np.uint8))
        assert isinstance(status, TransferFailed), status
        assert "refused the connection" in str(status) and "transfer.max_connections=3" in str(status), status

        for s in held[1:]:
            s.close()
        srv.wait_stats(lambda s: s["connections"] == 1)  # released before the next one comes
        held = [held[0], _hold(port, "127.0.0.1")]  # 127.0.0.1 at its cap of 2; 2 in all
        assert srv.wait_stats(lambda s: s["connections"] == 2)["connections"] == 2
        status = _run(eng, srv, "write", 0, np.ones(64, dtype=np.uint8))
        assert isinstance(status, TransferFailed), status
        assert "127.0.0.1 has 2 connections open" in str(status), status
        assert "transfer.max_connections_per_peer=2" in str(status), status

        st = srv.stats()
        assert st["refused"] == 2 and st["connections"] == 2
        log = srv.log()
        assert "refused transfer connection from 127.0.0.1" in log and "max_connections_per_peer=2" in log

        for s in held:
            s.close()
        assert srv.wait_stats(lambda s: s["connections"] == 0)["connections"] == 0
        _read_ok(eng, srv, 0, 64)  # the refused write changed nothing
        new = np.arange(100, dtype=np.uint8)
        assert _run(eng, srv, "write", 500, new) is None
        _read_ok(eng, srv, 500, 100, new.tobytes())


@pytest.mark.timeout(120)
def test_idle_and_slow_connections_are_closed_within_their_timeouts(engines):
    with LimitedServer("transfer", config={"idle_timeout_ms": 500, "frame_timeout_ms": 500}) as srv:
        port = srv.info["port"]
        frame = wire.encode_request(wire.OP_READ, 1, [(srv.info["region"], 0, 64)])
        t_idle = closed_within(authenticated(socket.create_connection(("127.0.0.1", port), timeout=5), "data"), 5)
        half = authenticated(socket.create_connection(("127.0.0.1", port), timeout=5), "data")
        half.sendall(frame[: wire.PREFIX.size // 2])  # half a frame header, then nothing
        t_half = closed_within(half, 5)
        trickle = authenticated(socket.create_connection(("127.0.0.1", port), timeout=5), "data")
        t_trickle = closed_within(trickle, 5, frame, every_s=0.1)  # a byte every 100 ms: never a whole frame
        for t in (t_idle, t_half, t_trickle):
            assert t is not None and 0.3 < t < 2.5, (t_idle, t_half, t_trickle)
        # a close reaches the counters through the server's event queue, a moment after the socket sees it
        st = srv.wait_stats(lambda s: s["closed_idle"] >= 1 and s["closed_slow"] >= 2, timeout_s=5)
        assert st["closed_idle"] >= 1 and st["closed_slow"] >= 2, st
        assert "transfer.frame_timeout_ms" in srv.log()
        eng = engines()
        _read_ok(eng, srv, 12345, 5000)
        new = np.full(5000, 7, dtype=np.uint8)
        assert _run(eng, srv, "write", 12345, new) is None
        _read_ok(eng, srv, 12345, 5000, new.tobytes())


@pytest.mark.timeout(120)
def test_pooled_connections_closed_for_idleness_reconnect_transparently(engines):
    with LimitedServer("transfer", config={"idle_timeout_ms": 300}) as srv:
        eng = engines(tcp_connections=4)
        _read_ok(eng, srv, 0, REGION_SIZE)  # 4 MiB: spread over up to 4 pooled connections
        pooled = srv.stats()["connections"]
        assert pooled >= 1
        st = srv.wait_stats(lambda s: s["connections"] == 0)
        assert st["connections"] == 0 and st["closed_idle"] >= pooled, st
        _read_ok(eng, srv, 0, REGION_SIZE)  # every pooled connection was closed: none fails
        new = np.frombuffer(np.random.default_rng(1).bytes(REGION_SIZE), dtype=np.uint8).copy()
        srv.wait_stats(lambda s: s["connections"] == 0)
        assert _run(eng, srv, "write", 0, new) is None
        _read_ok(eng, srv, 0, REGION_SIZE, new.tobytes())
