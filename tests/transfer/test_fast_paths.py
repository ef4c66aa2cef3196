"""Small batches in one native call from the engine's entry over TCP and cma (issue #35, kvplugins/transfer/
tcp_fast.py, cma_fast.py), against a real peer process: after the router ran a small batch to a region over the
transport as its first choice, the next ones to that region are checked and moved by the transport's native route
table (TCP: one frame over a pooled connection; cma: one process_vm_readv/writev), with the same bytes, digests
and errors as the general path; whatever a table cannot take or fails at ends on the general path, which names
the error. (RDMA's table: tests/rdma/guest/test_rdma_transport.py, in the soft-RoCE guest.)"""

import time

import numpy as np
import pytest
from xxhash import xxh3_64_intdigest

from helpers.peer import Peer, digest, seeded
from kvplugins.errors import OutOfRange, TransferFailed
from kvplugins.transfer import TransferConfig, TransferEngine, TransferRequest
from kvplugins.transfer.api import RegionInfo

PEER_SIZE = 4 << 20
SEED = 21
WRITE_AT = 3 << 20


@pytest.fixture(scope="module", params=["tcp", "cma"])
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def peer(transport):
    with Peer(transports=transport, size=PEER_SIZE, seed=SEED) as p:
        yield p


def transport_of(eng: TransferEngine, name: str = "tcp"):
    return next(t for t in eng._transports if t.name == name)  # noqa: SLF001 - the tests' view of its table


def fast_counts(eng: TransferEngine, name: str = "tcp") -> dict:
    return transport_of(eng, name).fast.counts()


def test_small_batches_after_the_first_run_natively_with_the_same_bytes_and_digests(transport, peer):
    want = seeded(PEER_SIZE, SEED)
    eng = TransferEngine(TransferConfig(transports=transport, timeout_ms=10000))

    def fast_counts(eng: TransferEngine) -> dict:
        return transport_of(eng, transport).fast.counts()

    try:
        dst = np.zeros(8 * 4096, np.uint8)
        reg = eng.register(dst)
        desc, rid = peer.descriptor, peer.region_id
        offs = [7 * 4096 * i + 55 for i in range(4)]

        def read() -> list:
            return eng.read_spans(desc, rid, [reg.addr + 4096 * i for i in range(4)], offs, [4096] * 4)

        def landed(n: int = 4) -> bool:
            return all(
                np.array_equal(dst[4096 * i : 4096 * (i + 1)], want[o : o + 4096]) for i, o in enumerate(offs[:n])
            )

        assert read() == [None] * 4 and landed()  # the general path: TCP was the first choice, the route is learnt
        assert fast_counts(eng) == {"reads": 0, "writes": 0, "entries": 0, "bytes": 0}
        dst[:] = 0
        assert read() == [None] * 4 and landed()
        assert fast_counts(eng) == {"reads": 1, "writes": 0, "entries": 4, "bytes": 4 * 4096}
        dst[:] = 0  # int64 / uint64 arrays: the same native call
        addrs = np.array([reg.addr + 4096 * i for i in range(4)], np.int64)
        assert eng.read_spans(desc, rid, addrs, np.array(offs, np.uint64), np.full(4, 4096)) == [None] * 4
        assert landed() and fast_counts(eng)["reads"] == 2
        dst[:] = 0  # TransferRequests to one remote region (the Mooncake TE API's batches): the same native call
        reqs = [TransferRequest(reg, 4096 * i, desc, rid, offs[i], 4096) for i in range(2)]
        assert eng.batch_read(reqs) == [None, None] and landed(2) and fast_counts(eng)["reads"] == 3
        dg = np.zeros(2, np.uint64)  # the digests of the bytes read (a store get)
        assert eng.read_spans(desc, rid, [reg.addr, reg.addr + 4096], offs[:2], [4096] * 2, digests=dg) == [None] * 2
        assert dg.tolist() == [xxh3_64_intdigest(bytes(want[o : o + 4096])) for o in offs[:2]]
        assert fast_counts(eng)["reads"] == 4

        src = np.frombuffer(np.random.default_rng(5).bytes(2 * 4096), np.uint8).copy()
        sreg = eng.register(src)
        wd = np.zeros(2, np.uint64)
        for k in range(2):  # the first write learns nothing new (the route is the region's): both run natively
            assert eng.write_spans(desc, rid, [sreg.addr, sreg.addr + 4096], [WRITE_AT, WRITE_AT + 8192],
                                   [4096] * 2, digests=wd) == [None] * 2  # fmt: skip
        assert fast_counts(eng)["writes"] == 2 and int(wd[1]) == xxh3_64_intdigest(src[4096:].tobytes())
        assert peer.digest(WRITE_AT, 4096) == digest(src[:4096]) and peer.digest(WRITE_AT + 8192, 4096) == digest(
            src[4096:]
        )
        before = fast_counts(eng)["writes"]  # fenced (a store put): TCP's frames carry a land-by time (general
        assert eng.write_spans(desc, rid, [sreg.addr], [WRITE_AT + 4 * 4096], [4096], fenced=True) == [None]  # path)
        assert fast_counts(eng)["writes"] == before + (transport == "cma")  # a copy never lands late
        assert peer.digest(WRITE_AT + 4 * 4096, 4096) == digest(src[:4096])
        stats = eng.stats()
        assert stats[transport]["entries"] == 4 + 4 + 4 + 2 + 2 + 2 * 2 + 1  # the native batches' spans counted too
        assert stats[transport]["bytes"] == 21 * 4096 and stats["batches"] == {"read": 5, "write": 3}
    finally:
        eng.close()


def test_what_the_table_cannot_take_gets_the_general_paths_errors(transport, peer):
    """Spans past the remote region or outside registered memory, a read into read-only memory, a write into a
    region read-only to peers, too many spans: not taken, the general path answers."""
    want = seeded(PEER_SIZE, SEED)
    eng = TransferEngine(TransferConfig(transports=transport, timeout_ms=10000))

    def fast_counts(eng: TransferEngine) -> dict:
        return transport_of(eng, transport).fast.counts()

    try:
        dst = np.zeros(64 * 4096, np.uint8)
        reg = eng.register(dst)
        desc, rid = peer.descriptor, peer.region_id
        assert eng.read_spans(desc, rid, [reg.addr], [0], [4096]) == [None]  # learns the route
        [beyond] = eng.read_spans(desc, rid, [reg.addr], [PEER_SIZE - 100], [4096])
        spare = np.zeros(4096, np.uint8)  # never registered
        [unregistered] = eng.read_spans(desc, rid, [spare.ctypes.data], [0], [4096])
        ro = eng.register(bytes(4096))  # read-only memory: a write source, never a read destination
        [into_ro] = eng.read_spans(desc, rid, [ro.addr], [0], [4096])
        assert isinstance(beyond, OutOfRange) and isinstance(unregistered, OutOfRange)
        assert isinstance(into_ro, OutOfRange) and not spare.any()
        assert fast_counts(eng)["reads"] == 0
        many = eng.read_spans(desc, rid, [reg.addr + 4096 * i for i in range(64)], [8192 * i for i in range(64)],
                              [4096] * 64)  # fmt: skip
        assert many == [None] * 64 and fast_counts(eng)["reads"] == 0  # more spans than spans.SMALL
        assert np.array_equal(dst[4096:8192], want[8192 : 8192 + 4096])

        gid = peer.guarded_id  # exported read-only to peers
        assert eng.read_spans(desc, gid, [reg.addr], [0], [4096]) == [None]  # learns a route to it
        assert eng.read_spans(desc, gid, [reg.addr], [0], [4096]) == [None] and fast_counts(eng)["reads"] == 1
        src = np.full(4096, 0xAB, np.uint8)
        sreg = eng.register(src)
        guarded = peer.digest(0, 4096, gid)
        [refused] = eng.write_spans(desc, gid, [sreg.addr], [0], [4096])
        assert isinstance(refused, OutOfRange) and "read-only to peers" in str(refused)
        assert fast_counts(eng)["writes"] == 0 and peer.digest(0, 4096, gid) == guarded
        eng.unregister(reg)  # its memory is no longer registered: nothing is read into it
        dst[:] = 0
        [gone] = eng.read_spans(desc, rid, [reg.addr], [0], [4096])
        assert isinstance(gone, OutOfRange) and not dst.any() and fast_counts(eng)["reads"] == 1
    finally:
        eng.close()


def test_a_failed_native_tcp_batch_ends_on_the_general_path():
    """A route the peer refuses at the frame (here one claiming the region longer than it is) fails natively:
    the route is dropped and the general path answers with its error; the next batch learns the route again."""
    eng = TransferEngine(TransferConfig(transports="tcp", timeout_ms=10000))
    try:
        dst = np.zeros(4096, np.uint8)
        reg = eng.register(dst)
        with Peer(transports="tcp", size=PEER_SIZE, seed=SEED) as peer:
            desc, rid = peer.descriptor, peer.region_id
            assert eng.read_spans(desc, rid, [reg.addr], [0], [4096]) == [None]
            ep = desc.transports["tcp"]
            transport_of(eng).fast.put(desc, RegionInfo(rid, 2 * PEER_SIZE), f"{ep['host']}:{ep['port']}", 1 << 20)
            [beyond] = eng.read_spans(desc, rid, [reg.addr], [PEER_SIZE], [4096])  # sent natively, refused there
            assert isinstance(beyond, OutOfRange) and fast_counts(eng)["reads"] == 0
            assert eng.read_spans(desc, rid, [reg.addr], [0], [4096]) == [None]  # the general path: learnt again
            assert eng.read_spans(desc, rid, [reg.addr], [0], [4096]) == [None] and fast_counts(eng)["reads"] == 1
            assert np.array_equal(dst, seeded(PEER_SIZE, SEED)[:4096])
    finally:
        eng.close()


@pytest.mark.parametrize(("name", "fault"), [("tcp", "killed"), ("tcp", "stopped"), ("cma", "killed")])
def test_a_dead_or_hung_peer_fails_within_the_timeout(name, fault):
    """A peer SIGKILLed (TCP: connection reset; cma: its pidfd says it exited) or SIGSTOPped (TCP: no answer)
    under a learnt route: the native batch fails, the general path names the failure (TransferFailed), within
    about one timeout, never a hang."""
    eng = TransferEngine(TransferConfig(transports=name, timeout_ms=1500))
    try:
        dst = np.zeros(4096, np.uint8)
        reg = eng.register(dst)
        with Peer(transports=name, size=1 << 20, seed=3) as p:
            for _ in range(2):
                assert eng.read_spans(p.descriptor, p.region_id, [reg.addr], [0], [4096]) == [None]
            assert fast_counts(eng, name)["reads"] == 1
            p.kill() if fault == "killed" else p.stop()
            t0 = time.monotonic()
            [err] = eng.read_spans(p.descriptor, p.region_id, [reg.addr], [0], [4096])
            took = time.monotonic() - t0
            assert isinstance(err, TransferFailed) and took < 1.5 * 1.5 + 1, (err, took)
            assert fast_counts(eng, name)["reads"] == 1
    finally:
        eng.close()


def test_a_pooled_connection_the_peer_closed_idle_leaves_the_batch_to_the_general_path():
    """The peer closes connections idle for idle_timeout_ms (the default 10 min, here 300 ms): a learnt route's
    next batch finds its pooled connection closed, moves nothing natively, and the general path reconnects and
    serves it; the batch after that runs natively again on the fresh connection."""
    eng = TransferEngine(TransferConfig(transports="tcp", timeout_ms=10000))
    try:
        dst = np.zeros(4096, np.uint8)
        reg = eng.register(dst)
        with Peer(transports="tcp", size=1 << 20, seed=4, idle_timeout_ms=300) as p:
            want = seeded(1 << 20, 4)

            def read(off: int) -> bool:
                dst[:] = 0
                done = eng.read_spans(p.descriptor, p.region_id, [reg.addr], [off], [4096]) == [None]
                return done and np.array_equal(dst, want[off : off + 4096])

            assert read(0) and read(4096) and fast_counts(eng)["reads"] == 1
            time.sleep(0.9)  # the peer's server closes the idle pooled connection
            assert read(8192) and fast_counts(eng)["reads"] == 1
            assert read(12288) and fast_counts(eng)["reads"] == 2
    finally:
        eng.close()
