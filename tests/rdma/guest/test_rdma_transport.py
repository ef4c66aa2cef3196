"""The RDMA transport on real verbs: soft-RoCE (rdma_rxe) devices rxe0 and rxe1 on eth0 and eth1 of the QEMU
guest (ci/rxe-guest.sh --nics 2), real peer processes, byte-verified data.

Striping over both NICs; a NIC's link going down mid-batch; a queue pair forced into the error state and rebuilt;
a peer without the shared secret refused before any queue pair is connected; store put/get over RDMA."""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from xxhash import xxh3_64_intdigest

from helpers.auth import use_secret
from helpers.cluster import store_cluster
from helpers.peer import Peer, digest, seeded
from kvplugins.errors import TransferFailed
from kvplugins.transfer import TransferConfig, TransferEngine, TransferRequest

MIB = 1 << 20
PEER_SIZE = 96 * MIB
WRITE_AT = 72 * MIB  # the striping test writes here; the read tests compare 0..72 MiB with the seeded bytes
FAST_PROBE = {"rdma_probe_ms": 200.0}


def rdma_engine(**kw) -> TransferEngine:
    return TransferEngine(TransferConfig(**{"transports": "rdma,tcp", "timeout_ms": 60000, **FAST_PROBE, **kw}))


@pytest.fixture(scope="module")
def peer():
    with Peer(transports="rdma,tcp", size=PEER_SIZE, seed=3, **FAST_PROBE) as p:
        yield p


def rdma_of(eng_or_stats) -> dict:
    stats = eng_or_stats if isinstance(eng_or_stats, dict) else eng_or_stats.stats()
    return stats["rdma"]


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def link(dev: str, state: str) -> None:
    subprocess.run(["ip", "link", "set", dev, state], check=True)


def reads(eng, peer, n: int, size: int = MIB, base: int = 0):
    dst = np.zeros(n * size, np.uint8)
    reg = eng.register(dst)
    return dst, [
        TransferRequest(reg, i * size, peer.descriptor, peer.region_id, base + i * size, size) for i in range(n)
    ]


def test_descriptor_carries_nics_and_rkeys(peer):
    ep = peer.descriptor.transports["rdma"]
    assert ep["nics"] == ["rxe0", "rxe1"] and ep["nets"] == ["10.77.0.15/24", "10.77.1.15/24"]
    info = peer.descriptor.region(peer.region_id)
    assert info.rdma is not None and len(info.rdma[1]) == 2 and info.rdma[1][0] != info.rdma[1][1]
    hidden = [r.region_id for r in peer.descriptor.regions]
    assert peer.hidden_id not in hidden  # a registered, unexported region publishes no rkey


def test_batch_is_striped_over_both_nics(peer):
    eng = rdma_engine()
    try:
        src = np.frombuffer(np.random.default_rng(1).bytes(16 * MIB), np.uint8).copy()
        reg = eng.register(src)
        reqs = [
            TransferRequest(reg, i * MIB, peer.descriptor, peer.region_id, WRITE_AT + i * MIB, MIB) for i in range(16)
        ]
        assert eng.batch_write(reqs) == [None] * 16
        assert peer.digest(WRITE_AT, 16 * MIB) == digest(src)
        r = rdma_of(eng)
        assert r["striped_batches"] >= 1 and set(r["path_bytes"]) == {"rxe0->0", "rxe1->1"}, r
        assert min(r["path_bytes"].values()) >= 4 * MIB, r  # neither NIC idles
        assert eng.stats()["rdma"]["bytes"] == 16 * MIB and not eng.stats()["fallbacks"]
    finally:
        eng.close()


def test_link_down_mid_batch_loses_nothing_and_is_probed_back(peer):
    eng = rdma_engine()
    try:
        dst, reqs = reads(eng, peer, 48)
        assert eng.batch_read(reqs[:2]) == [None, None]  # QPs up on both paths
        out = {}
        worker = threading.Thread(target=lambda: out.setdefault("st", eng.batch_read(reqs)))
        worker.start()
        time.sleep(0.3)
        link("eth1", "down")
        try:
            worker.join(120)
            assert out["st"] == [None] * 48
            assert np.array_equal(dst, seeded(PEER_SIZE, 3)[: 48 * MIB])
            wait_for(lambda: rdma_of(eng)["nics_up"] == 1, "rxe1 taken out")
            before = dict(rdma_of(eng)["path_bytes"])
            dst2, reqs2 = reads(eng, peer, 8, base=48 * MIB)
            assert eng.batch_read(reqs2) == [None] * 8
            after = rdma_of(eng)["path_bytes"]
            assert after.get("rxe1->1", 0) == before.get("rxe1->1", 0)  # the down NIC carried nothing
            assert np.array_equal(dst2, seeded(PEER_SIZE, 3)[48 * MIB : 56 * MIB])
        finally:
            link("eth1", "up")
        wait_for(lambda: rdma_of(eng)["nics_up"] == 2, "rxe1 probed back")
        wait_for(lambda: _both_paths_carry(eng, peer), "striping over both NICs again")
    finally:
        eng.close()


def _both_paths_carry(eng, peer) -> bool:
    before = dict(rdma_of(eng)["path_bytes"])
    _, reqs = reads(eng, peer, 8, base=56 * MIB)
    assert eng.batch_read(reqs) == [None] * 8
    after = rdma_of(eng)["path_bytes"]
    return all(after.get(k, 0) > before.get(k, 0) for k in ("rxe0->0", "rxe1->1"))


def test_qp_in_error_state_is_rebuilt(peer):
    """Every pooled QP of the engine is moved to the error state behind its back (as a NIC reset or a peer's
    fatal error would): the next batch still completes with the right bytes (on TCP where no QP is left), and
    the QPs are rebuilt in the background, after which RDMA carries the batches again."""
    eng = rdma_engine(rdma_devices="rxe0")
    try:
        dst, reqs = reads(eng, peer, 4)
        assert eng.batch_read(reqs) == [None] * 4
        rdma = next(t for t in eng._transports if t.name == "rdma")  # noqa: SLF001 - the test's fault injection
        qps = rdma._qps.idle()  # noqa: SLF001
        assert qps
        for q in qps:
            q.kill()  # ibv_modify_qp to IBV_QPS_ERR; the pool still holds it as idle
        dst[:] = 0
        assert eng.batch_read(reqs) == [None] * 4
        assert np.array_equal(dst, seeded(PEER_SIZE, 3)[: 4 * MIB])
        assert rdma_of(eng)["path_failures"] >= 1
        wait_for(lambda: rdma_of(eng)["qp_rebuilds"] >= 1, "a QP rebuild")
        fallbacks = sum(eng.stats()["fallbacks"].values())
        wait_for(
            lambda: eng.batch_read(reqs) == [None] * 4 and sum(eng.stats()["fallbacks"].values()) == fallbacks,
            "a batch carried by RDMA again",
        )
    finally:
        eng.close()


def test_small_batches_take_the_fast_path_and_a_failed_one_ends_on_the_general_path(peer):
    """A small batch (read_spans/write_spans of a few spans, or a few TransferRequests to one remote region) after
    the first good batch to a peer runs over the path that batch took in one native call (RdmaTransport.fast_spans,
    which teaches the route to the native table); from then on it is checked and posted by the native route table
    straight from the engine's entry (rdma_fast.py: no Python in between). Spans outside the remote region or
    registered memory still get the general path's errors; digests (the store's checksums) are hashed there too and
    a fenced write is taken (rdma's fence is its deadline). A route whose work request fails (here an rkey the peer
    never issued: a remote access error) ends with its queue pair killed, the route dropped, the path marked, and
    the general path serving the batch with the right bytes; a route whose queue pair died is not taken."""
    eng = rdma_engine(rdma_devices="rxe0")
    try:
        dst = np.zeros(8 * 4096, np.uint8)
        reg = eng.register(dst)
        want = seeded(PEER_SIZE, 3)
        desc, rid = peer.descriptor, peer.region_id
        offs = [5 * 4096 * i + 123 for i in range(4)]
        rdma = next(t for t in eng._transports if t.name == "rdma")  # noqa: SLF001 - the test's fault injection

        def read() -> list:
            return eng.read_spans(desc, rid, [reg.addr + 4096 * i for i in range(4)], offs, [4096] * 4)

        def landed(n: int = 4) -> bool:
            return all(
                np.array_equal(dst[4096 * i : 4096 * (i + 1)], want[o : o + 4096]) for i, o in enumerate(offs[:n])
            )

        assert read() == [None] * 4  # the general path: learns the path
        fast0 = rdma_of(eng)["fast_batches"]
        assert read() == [None] * 4  # the path's fast call: learns the native route
        assert rdma_of(eng)["fast_batches"] == fast0 + 1 and rdma.fast.counts()["reads"] == 0
        dst[:] = 0
        addrs = np.array([reg.addr + 4096 * i for i in range(4)], np.int64)  # an int64 array: the same native call
        assert eng.read_spans(desc, rid, addrs, np.array(offs, np.uint64), np.full(4, 4096)) == [None] * 4
        assert read() == [None] * 4 and landed()
        assert rdma.fast.counts() == {"reads": 2, "writes": 0, "entries": 8, "bytes": 8 * 4096, "wrs": 8}
        assert rdma_of(eng)["fast_batches"] == fast0 + 3 and eng.stats()["rdma"]["entries"] >= 16
        src = np.frombuffer(np.random.default_rng(8).bytes(4096), np.uint8).copy()
        sreg = eng.register(src)
        wd = np.zeros(1, np.uint64)  # fenced, with digests (a store put): the same native call
        assert eng.write_spans(desc, rid, [sreg.addr], [WRITE_AT + 4096], [4096], digests=wd, fenced=True) == [None]
        assert rdma.fast.counts()["writes"] == 1 and peer.digest(WRITE_AT + 4096, 4096) == digest(src)
        assert int(wd[0]) == xxh3_64_intdigest(src.tobytes())
        dst[:] = 0  # TransferRequest objects to one remote region: the same native call
        reqs = [TransferRequest(reg, 4096 * i, desc, rid, offs[i], 4096) for i in range(2)]
        assert eng.batch_read(reqs) == [None, None] and rdma.fast.counts()["reads"] == 3 and landed(2)
        dg = np.zeros(2, np.uint64)  # the digests of the bytes read (a store get): the same native call
        assert eng.read_spans(desc, rid, [reg.addr, reg.addr + 4096], offs[:2], [4096] * 2, digests=dg) == [None] * 2
        assert dg.tolist() == [xxh3_64_intdigest(bytes(want[o : o + 4096])) for o in offs[:2]]
        assert rdma.fast.counts()["reads"] == 4
        [beyond] = eng.read_spans(desc, rid, [reg.addr], [PEER_SIZE - 100], [4096])  # the general path names it
        spare = np.zeros(4096, np.uint8)  # never registered
        [unregistered] = eng.read_spans(desc, rid, [spare.ctypes.data], [0], [4096])
        assert type(beyond).__name__ == "OutOfRange" and type(unregistered).__name__ == "OutOfRange"
        assert rdma.fast.counts()["reads"] == 4 and not spare.any()

        base, rkeys = desc.region(rid).rdma  # a route whose rkey the peer never issued: remote access error
        qp, path = rdma._qps.idle()[0], rdma._fast[desc.segment_id]  # noqa: SLF001
        rdma.fast.put(desc, rid, qp, path, base, desc.region(rid).length, rkeys[0] ^ 0x5A5A5A)
        failures = rdma_of(eng)["path_failures"]
        dst[:] = 0
        assert read() == [None] * 4 and landed()  # failed natively, served by the general path
        assert qp.dead and rdma_of(eng)["path_failures"] == failures + 1 and rdma.fast.counts()["reads"] == 4
        # the path is down until probed back (rdma_probe_ms), then the route is learnt again
        wait_for(lambda: read() == [None] * 4 and rdma.fast.counts()["reads"] > 4, "native small reads again")
        for q in rdma._qps.idle():  # noqa: SLF001 - the native route's queue pair killed behind its back
            q.kill()
        reads_before, dst[:] = rdma.fast.counts()["reads"], 0
        assert read() == [None] * 4 and landed()  # not taken natively: the general path serves it
        assert rdma.fast.counts()["reads"] == reads_before
    finally:
        eng.close()


def test_peer_without_the_secret_is_refused_before_any_qp(monkeypatch):
    secret = "rdma-secret-" + "7a" * 16
    with pytest.MonkeyPatch.context() as mp:
        use_secret(mp, secret)
        holder = Peer(transports="rdma,tcp", size=4 * MIB, seed=9)
    with holder:
        use_secret(monkeypatch, None)
        eng = rdma_engine(timeout_ms=10000)
        try:
            dst, reqs = reads(eng, holder, 1)
            [err] = eng.batch_read(reqs)
            assert isinstance(err, TransferFailed) and "authentication" in str(err), err
            assert not dst.any()
            assert rdma_of(holder.stats())["qps_served"] == 0
        finally:
            eng.close()
        use_secret(monkeypatch, secret)
        eng = rdma_engine()
        try:
            dst, reqs = reads(eng, holder, 1)
            assert eng.batch_read(reqs) == [None]
            assert np.array_equal(dst, seeded(4 * MIB, 9)[:MIB])
            assert rdma_of(holder.stats())["qps_served"] >= 1 and not eng.stats()["fallbacks"]
        finally:
            eng.close()


def test_store_put_get_over_rdma_between_processes():
    from kvplugins.store import ClientConfig, StoreClient
    from kvplugins.mooncake import MooncakeDistributedStore

    with store_cluster(nodes=1, segment_size="32MiB", node_flags={"transports": "rdma,tcp"}) as cluster:
        client = StoreClient(ClientConfig(master=cluster.master, transports="rdma,tcp", rpc_timeout_ms=30000))
        try:
            pages = [np.random.default_rng(i).bytes(256 << 10) for i in range(8)]
            keys = [f"rdma/{i}" for i in range(8)]
            assert client.batch_put(keys, pages) == [None] * 8
            assert client.batch_get(keys) == pages
            t = client.transfer_stats()
            assert t["rdma"]["bytes"] >= 2 * 8 * (256 << 10) and t["tcp"]["bytes"] == 0, t
            small = np.random.default_rng(9).bytes(4096)  # small ops, checksummed: the native route table's
            assert client.put("rdma/small", small) is None
            assert [client.get("rdma/small") for _ in range(3)] == [small] * 3
            assert client.transfer_stats()["rdma"]["native_batches"] >= 1
        finally:
            client.close()
        mooncake = MooncakeDistributedStore()  # Mooncake's setup(protocol="rdma") takes our RDMA transport
        assert mooncake.setup("127.0.0.1", "", 0, 16 << 20, "rdma", "rxe0", cluster.master) == 0
        try:
            assert mooncake.put("rdma/mooncake", pages[0]) == 0 and mooncake.get("rdma/mooncake") == pages[0]
            t = mooncake._client.transfer_stats()  # noqa: SLF001 - which transport carried the bytes
            assert t["rdma"]["bytes"] >= 2 * len(pages[0]) and set(t["rdma"]["path_bytes"]) == {"rxe0->0"}, t
        finally:
            mooncake.close()


EXIT_SCRIPT = """
import sys
import numpy as np
from kvplugins.store import ClientConfig, StoreClient
client = StoreClient(ClientConfig(master=sys.argv[1], transports="rdma,tcp", rpc_timeout_ms=30000))
pages = [np.random.default_rng(i).bytes(4 << 20) for i in range(16)]
keys = [f"exit/{i}" for i in range(16)]
assert client.batch_put(keys, pages) == [None] * 16
assert client.batch_get(keys) == pages
t = client.transfer_stats()
assert t["rdma"]["bytes"] >= 2 * (64 << 20) and t["tcp"]["bytes"] == 0, t
print("ok")
"""


def test_a_store_client_over_rdma_exits_0_and_silently():
    """A process whose store client moved 64 MiB each way over rdma (byte-verified) exits 0 with nothing on stderr
    and without closing its client: the verbs layer's queue pairs, MRs and devices are torn down at exit (it
    aborted with "terminate called without an active exception" over pyverbs)."""
    with store_cluster(nodes=1, segment_size="160MiB", node_flags={"transports": "rdma,tcp"}) as cluster:
        r = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT, cluster.master], capture_output=True, text=True, timeout=600
        )
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, "ok", ""), r
