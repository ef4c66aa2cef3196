"""A fenced write lands by its deadline or not at all, also at the receiving end (issue #34): the store grants a
put's or a re-replication's destination only until a deadline, then may give the space to another object. A TCP
write the writer was told failed still sat in the receiver's socket buffer when the receiving node was frozen
(SIGSTOP) or stalled, and landed when it resumed: over another object's bytes. Now the frames carry the deadline
("dl", unix ms, kvplugins/transfer/wire.py) and the server drops what it reads after it. Real server processes:
a Peer (tests/helpers/peer.py) frozen with SIGSTOP, and a LimitedServer fed raw frames over an authenticated
socket; TCP only (shm, same-host and RDMA writes are one-sided: no receiving stage to check)."""

import os
import signal
import socket
import time

import numpy as np

from helpers.auth import authenticated
from helpers.limited_server import REGION_SIZE, SEED, LimitedServer
from helpers.peer import Peer, seeded
from kvplugins.errors import TransferFailed
from kvplugins.transfer import SegmentDescriptor, TransferConfig, TransferEngine, wire
from kvplugins.transfer.sockio import recv_exact

KIB = 1 << 10
EXPECTED = seeded(REGION_SIZE, SEED).tobytes()


def test_a_fenced_write_queued_at_a_frozen_peer_lands_nothing_when_it_resumes_late():
    """The write's frame reaches the frozen peer's socket buffer; the writer times out (and resets the
    connection); the peer resumes after the deadline: without the fence its bytes landed then (checked here).
    16 KiB: the whole frame fits the frozen receiver's TCP window (64 KiB did not always: a frame cut short by
    the reset lands in part). The bytes are read once the peer's server has closed that connection, so after
    it has read (and dropped or landed) everything the socket held."""
    with TransferEngine(TransferConfig(transports="tcp")) as eng, Peer(transports="tcp", size=1 << 20, seed=3) as peer:
        before = seeded(1 << 20, 3)
        warm = eng.register(np.full(4 * KIB, 0x11, dtype=np.uint8))
        stale = eng.register(np.full(16 * KIB, 0xEE, dtype=np.uint8))
        for fenced in (True, False):  # a pooled connection, authenticated while the peer ran
            assert eng.write_spans(peer.descriptor, peer.region_id, [warm.addr], [512 * KIB], [4 * KIB]) == [None]
            peer.stop()
            [err] = eng.write_spans(
                peer.descriptor, peer.region_id, [stale.addr], [0], [16 * KIB], timeout_ms=400, fenced=fenced
            )
            assert isinstance(err, TransferFailed) and "did not answer within the 400 ms" in str(err)
            time.sleep(0.2)
            os.kill(peer.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 10
            while peer.stats()["tcp"]["server_connections"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert peer.stats()["tcp"]["server_connections"] == 0, "the reset connection was never closed"
            got = np.frombuffer(peer.read(0, 16 * KIB), dtype=np.uint8)
            # fenced: untouched; unfenced (a plain batch's semantics): the late bytes land on resume
            assert (got == before[: 16 * KIB]).all() if fenced else (got == 0xEE).all(), f"fenced={fenced}"


def _raw_write(port: int, region: int, entries: list[tuple[int, bytes]], land_by_ms: int, pause_after: int = -1):
    """One write frame over a fresh authenticated connection: ``entries`` (offset, bytes); the connection pauses
    1 s after sending ``pause_after`` bytes of payload (-1: never). Returns the per-entry statuses."""
    payload = b"".join(d for _, d in entries)
    frame = wire.encode_request(wire.OP_WRITE, 7, [(region, off, len(d)) for off, d in entries], land_by_ms)
    with authenticated(socket.create_connection(("127.0.0.1", port), timeout=5), "data") as sock:
        if pause_after < 0:
            sock.sendall(frame + payload)
        else:
            sock.sendall(frame + payload[:pause_after])
            time.sleep(1.0)
            sock.sendall(payload[pause_after:])
        hlen, _ = wire.parse_prefix(recv_exact(sock, wire.PREFIX.size), 1 << 30)
        return wire.decode_response(recv_exact(sock, hlen), 7, len(entries))


def test_the_server_drops_a_write_frame_read_after_its_deadline():
    """Late at its header: nothing lands; late in its payload (the writer pauses past the deadline): what comes
    after lands nowhere, and every entry, the one that landed in time too, answers "late write"; in time: lands."""
    with LimitedServer("transfer") as srv:
        port, region = srv.info["port"], srv.info["region"]
        now_ms = int(time.time() * 1000)
        a, b = b"\xaa" * (64 * KIB), b"\xbb" * (64 * KIB)
        st = _raw_write(port, region, [(0, a)], now_ms - 1)
        assert len(st) == 1 and st[0].startswith(wire.LATE_WRITE), st
        st = _raw_write(port, region, [(128 * KIB, a), (256 * KIB, b)], int(time.time() * 1000) + 400, 96 * KIB)
        assert all(s is not None and s.startswith(wire.LATE_WRITE) for s in st), st
        st = _raw_write(port, region, [(512 * KIB, b)], int(time.time() * 1000) + 10_000)
        assert st == [None]
        with TransferEngine(TransferConfig(transports="tcp")) as eng:
            buf = np.zeros(1 << 20, dtype=np.uint8)
            out = eng.register(buf)
            desc = SegmentDescriptor.from_wire(srv.info["descriptor"])
            assert eng.read_spans(desc, region, [out.addr], [0], [1 << 20]) == [None]
            got = buf.tobytes()
    assert got[: 64 * KIB] == EXPECTED[: 64 * KIB]  # late at its header
    # read before the deadline: the first entry and 32 KiB of the second are there; after it, nothing
    assert got[128 * KIB : 192 * KIB] == a and got[256 * KIB : 288 * KIB] == b[: 32 * KIB]
    assert got[288 * KIB : 320 * KIB] == EXPECTED[288 * KIB : 320 * KIB]
    assert got[512 * KIB : 576 * KIB] == b
