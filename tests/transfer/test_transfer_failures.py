"""Failures against real peer processes: a killed or hung peer gives TransferFailed within the timeout
(never a hang), a failing transport falls back to the next one (counted, logged once), and the server
answers out-of-range entries with a per-entry OutOfRange while the connection keeps working."""

import dataclasses
import logging
import os
import signal
import time

import numpy as np
import pytest

from helpers.peer import Peer, Writer, digest, seeded
from kvplugins.errors import OutOfRange, TransferFailed
from kvplugins.transfer import RegionInfo, TransferConfig, TransferEngine, TransferRequest

SIZE = 1 << 20


@pytest.fixture
def make_engine():
    engines = []

    def make(**kw):
        engines.append(TransferEngine(TransferConfig(**kw)))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


def _write(eng, peer, local, n=4, timeout_ms=None, descriptor=None, region=None):
    """n writes of 1000 bytes from local region ``local`` into the peer's region at misaligned offsets."""
    d = descriptor or peer.descriptor
    reqs = [TransferRequest(local, i * 1000, d, region or peer.region_id, i * 5000 + 1, 1000) for i in range(n)]
    return eng.batch_write(reqs, timeout_ms=timeout_ms)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_killed_peer_gives_transfer_failed_fast(make_engine, transport):
    eng = make_engine(transports=transport, timeout_ms=3000)
    src = np.arange(8000, dtype=np.uint8)
    local = eng.register(src)
    with Peer(transports=transport, size=SIZE) as peer:
        assert _write(eng, peer, local) == [None] * 4
        peer.kill()
        t0 = time.monotonic()
        st = _write(eng, peer, local)
        fut = eng.submit_write([TransferRequest(local, 0, peer.descriptor, peer.region_id, 0, 10)])
        st2 = fut.result(timeout=10)
        elapsed = time.monotonic() - t0
    assert all(isinstance(e, TransferFailed) for e in st + st2), st + st2
    assert elapsed < 3.0


def test_hung_peer_times_out_naming_peer_and_timeout(make_engine):
    eng = make_engine(transports="tcp")
    src = np.arange(8000, dtype=np.uint8)
    local = eng.register(src)
    with Peer(transports="tcp", size=SIZE) as peer:
        assert _write(eng, peer, local) == [None] * 4
        peer.stop()
        t0 = time.monotonic()
        st = _write(eng, peer, local, timeout_ms=400)
        elapsed = time.monotonic() - t0
    assert all(isinstance(e, TransferFailed) for e in st), st
    port = peer.descriptor.transports["tcp"]["port"]
    assert f"127.0.0.1:{port}" in str(st[0]) and "400 ms" in str(st[0])
    assert 0.35 < elapsed < 2.0


def _broken_shm(desc):
    """``desc`` with an shm endpoint whose fd socket nobody serves: the shm transport claims the regions and
    fails on them."""
    shm = {**desc.transports["shm"], "fd_socket": "kvp-fd-1-0123456789abcdef"}
    return dataclasses.replace(desc, transports={**desc.transports, "shm": shm})


def test_fallback_from_failing_shm_to_tcp_is_counted_and_logged_once(make_engine, caplog):
    eng = make_engine(transports="shm,tcp")
    src = np.frombuffer(np.random.default_rng(3).bytes(8000), dtype=np.uint8)
    local = eng.register(src)
    caplog.set_level(logging.WARNING, logger="kvplugins.transfer")
    with Peer(transports="shm,tcp", size=SIZE) as peer:
        broken = _broken_shm(peer.descriptor)
        assert _write(eng, peer, local, descriptor=broken) == [None] * 4
        assert _write(eng, peer, local, descriptor=broken) == [None] * 4
        assert peer.digest(3 * 5000 + 1, 1000) == digest(src[3000:4000])
    stats = eng.stats()
    assert stats["fallbacks"] == {"shm->tcp": 8}
    assert stats["tcp"]["entries"] == 8 and stats["shm"]["failed"] == 8
    assert sum("fell back from shm to tcp" in r.getMessage() for r in caplog.records) == 1


def test_killed_peer_fails_on_every_transport(make_engine):
    eng = make_engine(transports="shm,tcp", timeout_ms=3000)
    src = np.arange(8000, dtype=np.uint8)
    local = eng.register(src)
    with Peer(transports="shm,tcp", size=SIZE) as peer:
        assert _write(eng, peer, local) == [None] * 4
        assert eng.stats()["shm"]["entries"] == 4  # same host: shm chosen first
        peer.kill()
        st = _write(eng, peer, local)
    assert all(isinstance(e, TransferFailed) for e in st)
    assert eng.stats()["fallbacks"] == {"shm->tcp": 4}


def test_plain_region_goes_over_tcp_without_fallback(make_engine):
    eng = make_engine(transports="shm,tcp")
    src = np.arange(8000, dtype=np.uint8)
    local = eng.register(src)
    with Peer(transports="shm,tcp", size=SIZE) as peer:
        assert _write(eng, peer, local, region=peer.plain_id) == [None] * 4
        assert peer.digest(1, 1000, region=peer.plain_id) == digest(src[:1000])
    assert eng.stats()["tcp"]["entries"] == 4 and eng.stats()["fallbacks"] == {}


def test_server_answers_out_of_range_per_entry_and_keeps_the_connection(make_engine):
    eng = make_engine(transports="tcp", tcp_connections=1)
    src = np.frombuffer(np.random.default_rng(4).bytes(8192), dtype=np.uint8).copy()  # reads land here
    local = eng.register(src)
    with Peer(transports="tcp", size=SIZE) as peer:
        d = peer.descriptor  # a stale/lying descriptor: bigger region, and a region that is not exported
        lying = dataclasses.replace(d, regions=(RegionInfo(peer.region_id, SIZE * 2), RegionInfo(peer.hidden_id, 4096)))
        reqs = [
            TransferRequest(local, 0, lying, peer.region_id, 0, 4096),
            TransferRequest(local, 0, lying, peer.region_id, SIZE + 10, 4096),
            TransferRequest(local, 0, lying, peer.hidden_id, 0, 100),
            TransferRequest(local, 4096, lying, peer.region_id, 5000, 4096),
        ]
        for attempt in range(2):  # the same pooled connection serves the next batch
            st = eng.batch_write(reqs)
            assert st[0] is None and st[3] is None
            assert isinstance(st[1], OutOfRange) and "outside" in str(st[1])
            assert isinstance(st[2], OutOfRange) and "not exported" in str(st[2])
            rst = eng.batch_read(reqs)
            assert rst[0] is None and isinstance(rst[1], OutOfRange) and isinstance(rst[2], OutOfRange)
        assert peer.digest(5000, 4096) == digest(src[4096:])


def test_peer_killed_mid_transfer_fails_fast(make_engine):
    """The peer is frozen, a 32 MiB write fills the socket buffers and blocks mid-send, then the peer is
    killed: the batch ends with TransferFailed long before its timeout."""
    eng = make_engine(transports="tcp", timeout_ms=8000)
    size = 32 << 20
    local = eng.register(np.zeros(size, dtype=np.uint8))
    with Peer(transports="tcp", size=size) as peer:
        peer.stop()
        t0 = time.monotonic()
        fut = eng.submit_write([TransferRequest(local, 0, peer.descriptor, peer.region_id, 0, size)])
        time.sleep(0.3)
        assert not fut.done()  # blocked mid-send on the frozen peer
        peer.kill()
        st = fut.result(timeout=10)
    assert isinstance(st[0], TransferFailed) and "tcp peer 127.0.0.1" in str(st[0])
    assert time.monotonic() - t0 < 4.0


def test_a_writer_paused_past_its_deadline_sends_nothing_more_on_resume():
    """A TCP write batch whose process is frozen (SIGSTOP) mid-send and resumed after the batch's deadline sends
    no further byte: it ends TransferFailed, and the peer's region holds only what was in the sockets when the
    writer froze. Before, the resumed frame loop sent the rest of the batch first, landing a write its caller is
    told failed (in the store: on space already handed to another object)."""
    size = 48 << 20
    with Peer(transports="tcp", size=size, seed=5, frame_timeout_ms=60_000) as peer:
        before = seeded(size, 5)
        with Writer(peer, size, 0xAB, timeout_ms=1500) as w:
            peer.stop()
            w.go()
            time.sleep(0.5)  # the writer's socket fills and its frame loop waits in poll()
            os.kill(w.pid, signal.SIGSTOP)
            os.kill(peer.proc.pid, signal.SIGCONT)  # the peer takes what the sockets held
            time.sleep(2.0)  # past the writer's deadline
            landed = _landed(peer, before)
            os.kill(w.pid, signal.SIGCONT)
            status = w.result(timeout=10)
            time.sleep(0.5)
            assert status is not None and "TransferFailed" in status and "timeout" in status
            assert landed < size // 4  # the sockets' buffers, not the batch
            assert _landed(peer, before) == landed


def _landed(peer, before) -> int:
    """Bytes of the peer's region the writer changed (to 0xAB) so far."""
    got = np.frombuffer(peer.read(0, len(before)), dtype=np.uint8)
    return int(((got == 0xAB) & (before != 0xAB)).sum())
