"""The transfer core under a shared secret, against a real peer process: authenticated engines move bytes over
every transport; over TCP a peer with another secret (its per-user default, or a wrong one) is refused
(TransferFailed caused by AuthError, no byte read or written) and logged; an engine with no credential at all
does not start its TCP server; the handshake cannot be replayed; shared memory (same host) is owner-only (0600),
which is what protects it instead."""

import hmac
import logging
import os
import socket
import time

import numpy as np
import pytest

from helpers.auth import read_until_closed, use_secret
from helpers.peer import Peer
from kvplugins.errors import AuthError, ConfigError, TransferFailed
from kvplugins.security import Secret, ServerHandshake, handshake
from kvplugins.transfer import TransferConfig, TransferEngine, shmem, wire

SECRET = "transfer-secret-" + "5e" * 16
SIZE = 1 << 20


@pytest.fixture(scope="module")
def peer():
    """A peer process holding SECRET, offering shm and tcp."""
    with pytest.MonkeyPatch.context() as mp:
        use_secret(mp, SECRET)
        with Peer(transports="shm,tcp", size=SIZE, seed=5) as p:
            yield p


def _engine(monkeypatch, token: str | None, transports: str = "tcp") -> TransferEngine:
    use_secret(monkeypatch, token)
    return TransferEngine(TransferConfig(transports=transports, timeout_ms=3000))


@pytest.mark.parametrize("transports", ["shm", "tcp"])
def test_engines_holding_the_secret_move_bytes(peer, monkeypatch, transports):
    eng = _engine(monkeypatch, SECRET, transports)
    try:
        src = np.frombuffer(os.urandom(65536), np.uint8).copy()
        dst = np.zeros_like(src)
        a, b = eng.register(src).addr, eng.register(dst).addr
        off = {"shm": 0, "tcp": 65536}[transports]
        assert eng.write_spans(peer.descriptor, peer.region_id, [a], [off], [src.size]) == [None]
        assert eng.read_spans(peer.descriptor, peer.region_id, [b], [off], [src.size]) == [None]
        assert np.array_equal(src, dst)
        assert peer.read(off, 16) == src[:16].tobytes()
        assert eng.stats()  # counters exist for the transport used
    finally:
        eng.close()


@pytest.mark.parametrize("token, reason", [(None, "could not prove"), ("x" * 24, "could not prove")])
def test_tcp_refuses_a_peer_without_the_secret(peer, monkeypatch, token, reason):
    eng = _engine(monkeypatch, token)
    try:
        before = peer.digest(0, SIZE)
        src = np.full(4096, 0xAB, np.uint8)
        dst = np.zeros(4096, np.uint8)
        a, b = eng.register(src).addr, eng.register(dst).addr
        [werr] = eng.write_spans(peer.descriptor, peer.region_id, [a], [0], [src.size])
        [rerr] = eng.read_spans(peer.descriptor, peer.region_id, [b], [0], [dst.size])
        for err in (werr, rerr):
            assert isinstance(err, TransferFailed) and isinstance(err.__cause__, AuthError)
            assert reason in str(err) and "KVPLUGINS_AUTH_TOKEN_FILE" in str(err)
        assert peer.digest(0, SIZE) == before  # nothing written
        assert not dst.any()  # nothing read
    finally:
        eng.close()


def test_an_engine_without_any_credential_serves_nothing(monkeypatch):
    use_secret(monkeypatch, none=True)
    with pytest.raises(ConfigError, match="TCP transfer server has no shared secret"):
        TransferEngine(TransferConfig(transports="tcp"))


def test_a_secret_holder_refuses_a_peer_with_its_per_user_default(monkeypatch):
    with pytest.MonkeyPatch.context() as mp:
        use_secret(mp, None)
        with Peer(transports="tcp", size=SIZE, seed=6) as open_peer:
            eng = _engine(monkeypatch, SECRET)
            try:
                src = np.ones(4096, np.uint8)
                before = open_peer.digest(0, SIZE)
                [err] = eng.write_spans(
                    open_peer.descriptor, open_peer.region_id, [eng.register(src).addr], [0], [src.size]
                )
                assert isinstance(err.__cause__, AuthError) and "could not prove" in str(err)
                assert open_peer.digest(0, SIZE) == before
            finally:
                eng.close()


def test_an_unauthenticated_frame_is_refused_unserved_and_logged(monkeypatch, caplog):
    server = _engine(monkeypatch, SECRET)
    try:
        region = server.alloc_shared(SIZE)
        np.frombuffer(server.memoryview(region), np.uint8)[:] = 7
        ep = server.descriptor().transports["tcp"]
        caplog.set_level(logging.WARNING, logger="kvplugins.security")
        for op in (wire.OP_WRITE, wire.OP_READ):
            payload = bytes(4096) if op == wire.OP_WRITE else b""
            with socket.create_connection((ep["host"], ep["port"]), timeout=5) as s:
                s.sendall(wire.encode_request(op, 1, [(region.region_id, 0, 4096)]) + payload)
                answer = read_until_closed(s)
            assert answer[:4] == handshake.MAGIC and answer[5] == handshake.REFUSED and len(answer) == 72
        assert bytes(server.memoryview(region)[:4096]) == b"\x07" * 4096
        assert "refused transfer connection from 127.0.0.1:" in caplog.text
    finally:
        server.close()


def test_a_silent_connection_is_closed_after_the_frame_timeout(monkeypatch, caplog):
    use_secret(monkeypatch, SECRET)
    server = TransferEngine(TransferConfig(transports="tcp", timeout_ms=500))  # frame timeout: 1 s
    try:
        ep = server.descriptor().transports["tcp"]
        caplog.set_level(logging.WARNING, logger="kvplugins.security")
        t0 = time.monotonic()
        with socket.create_connection((ep["host"], ep["port"]), timeout=10) as s:
            assert read_until_closed(s) == b""
        assert 0.9 <= time.monotonic() - t0 < 5
        assert "did not authenticate within 1 s" in caplog.text
    finally:
        server.close()


def test_the_handshake_cannot_be_replayed():
    secret = Secret(SECRET.encode(), "test")
    key = secret.key("data")
    cn = os.urandom(32)

    def mac(label, *parts):
        return hmac.new(key, label + b"".join(parts), "sha256").digest()

    def challenge(server):
        out, outcome = server.feed(bytearray(handshake.message(handshake.HELLO, cn)))  # role 0: data
        assert outcome is None
        _, _, kind, _, _, sn, server_mac = handshake.MSG.unpack(out)
        assert kind == handshake.CHALLENGE and server_mac == mac(b"S", cn, sn)  # the server proved itself
        return sn

    first = ServerHandshake(secret, ("data",))
    proof = handshake.message(handshake.PROOF, mac=mac(b"C", challenge(first), cn))
    assert first.feed(bytearray(proof))[1] is True and first.role == "data"
    second = ServerHandshake(secret, ("data",))
    challenge(second)  # a fresh server nonce: the old proof is worthless
    out, outcome = second.feed(bytearray(proof))
    assert outcome is False and handshake.MSG.unpack(out)[2] == handshake.REFUSED
    reflected = ServerHandshake(secret, ("data",))  # the server's own answer is no client proof ("S" != "C")
    sn = challenge(reflected)
    assert reflected.feed(bytearray(handshake.message(handshake.PROOF, mac=mac(b"S", cn, sn))))[1] is False


def test_non_loopback_bind_needs_the_secret(monkeypatch):
    use_secret(monkeypatch, None)
    with pytest.raises(ConfigError, match="transfer host.*'0.0.0.0' is not a loopback address"):
        TransferEngine(TransferConfig(host="0.0.0.0", transports="tcp"))
    eng = _engine(monkeypatch, SECRET)
    eng.close()
    use_secret(monkeypatch, SECRET)
    TransferEngine(TransferConfig(host="0.0.0.0", transports="tcp")).close()
    use_secret(monkeypatch, "short")
    with pytest.raises(ConfigError, match="at least 16"):
        TransferEngine(TransferConfig(transports="tcp"))


@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_shared_memory_is_owner_only(backend):
    mapping = shmem.allocate(4096, backend)
    try:
        assert os.stat(mapping.path).st_mode & 0o777 == 0o600
        if os.getuid() != 0:
            pytest.skip("opening as another user needs root to switch users (mode checked above)")
        pid = os.fork()
        if pid == 0:  # child: become nobody, try to map the segment
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                open(mapping.path, "rb").close()
                code = 1
            except PermissionError:
                code = 0
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "another user could open the segment"
    finally:
        mapping.close()
