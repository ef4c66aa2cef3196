"""TransferEngine API in one process: memory forms, region lookup, descriptors, config validation,
alloc_shared backends. Transfers between two engines of this process use the real transports."""

import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from kvplugins.config import load
from kvplugins.errors import BufferNotRegistered, ConfigError, OutOfRange, TransferFailed
from kvplugins.transfer import SegmentDescriptor, TransferConfig, TransferEngine, TransferRequest, shmem


@pytest.fixture
def eng():
    with TransferEngine(TransferConfig(transports="shm,tcp")) as e:
        yield e


def test_register_numpy_bytearray_memoryview_and_address(eng):
    arr = np.zeros(100, dtype=np.float32)
    r = eng.register(arr)
    assert (r.addr, r.length, r.exported, r.shm_path) == (arr.ctypes.data, 400, False, None)
    eng.memoryview(r)[:4] = np.float32(1.5).tobytes()
    assert arr[0] == 1.5
    ba = bytearray(b"hello")
    rb = eng.register(ba, export=True)
    assert rb.length == 5 and rb.exported and bytes(eng.memoryview(rb)) == b"hello"
    mv = memoryview(bytearray(64)).cast("I")
    assert eng.register(mv).length == 64
    ra = eng.register(arr.ctypes.data + 8, length=16)
    assert (ra.addr, ra.length) == (arr.ctypes.data + 8, 16)
    assert eng.register(arr, length=10).length == 10


def test_register_torch_cpu_tensor(eng):
    torch = pytest.importorskip("torch")
    t = torch.arange(10, dtype=torch.int64)
    r = eng.register(t)
    assert (r.addr, r.length) == (t.data_ptr(), 80)
    with pytest.raises(TypeError, match="contiguous"):
        eng.register(torch.zeros(4, 4).t())


@pytest.mark.parametrize(
    "mem, kw, err, match",
    [
        (np.zeros((4, 4))[:, 0], {}, TypeError, "C-contiguous"),
        (12345, {}, TypeError, "length="),
        ("text", {}, TypeError, "numpy array"),
        (bytearray(8), {"length": 9}, OutOfRange, "length=9"),
        (bytearray(8), {"length": 0}, OutOfRange, "length=0"),
    ],
)
def test_register_rejects_bad_memory(eng, mem, kw, err, match):
    with pytest.raises(err, match=match):
        eng.register(mem, **kw)


def test_region_for_and_unregister(eng):
    arr = np.zeros(1000, dtype=np.uint8)
    r = eng.register(arr)
    assert eng.region_for(arr.ctypes.data + 10, 990) == r
    with pytest.raises(BufferNotRegistered):
        eng.region_for(arr.ctypes.data + 10, 991)
    eng.unregister(r)
    with pytest.raises(BufferNotRegistered):
        eng.unregister(r)
    with pytest.raises(BufferNotRegistered):
        eng.region_for(arr.ctypes.data, 1)


def test_unregistered_local_region_gives_out_of_range(eng):
    with TransferEngine(TransferConfig(transports="tcp")) as peer:
        remote = peer.alloc_shared(4096)
        r = eng.register(bytearray(16))
        eng.unregister(r)
        st = eng.batch_write([TransferRequest(r, 0, peer.descriptor(), remote.region_id, 0, 16)])
    assert isinstance(st[0], OutOfRange) and "not registered" in str(st[0])


def test_descriptor_lists_exported_regions_and_transports(eng):
    shared = eng.alloc_shared(8192)
    eng.register(bytearray(10))  # not exported
    plain = eng.register(bytearray(20), export=True)
    d = eng.descriptor()
    assert list(d.transports) == ["shm", "tcp"]
    assert d.transports["shm"]["pid"] == os.getpid() and d.transports["tcp"]["port"] > 0
    assert {(r.region_id, r.length) for r in d.regions} == {(shared.region_id, 8192), (plain.region_id, 20)}
    assert d.region(shared.region_id).shm_path == shared.shm_path
    again = SegmentDescriptor.from_wire(msgpack.unpackb(msgpack.packb(d.to_wire())))
    assert again == d


@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_alloc_shared_backends_move_bytes_between_engines(backend):
    """memfd memory is sealed and handed over as an fd (shm); posix memory cannot be sealed: it goes over TCP."""
    cfg = TransferConfig(transports="shm,tcp", shm_backend=backend)
    with TransferEngine(cfg) as a, TransferEngine(cfg) as b:
        region = b.alloc_shared(1 << 16)
        path = region.shm_path
        assert path.startswith("/proc/" if backend == "memfd" else "/dev/shm/kvp-")
        assert ("fd_socket" in b.descriptor().transports["shm"]) == (backend == "memfd")
        src = a.register(np.frombuffer(os.urandom(1 << 16), dtype=np.uint8))
        assert a.batch_write([TransferRequest(src, 0, b.descriptor(), region.region_id, 0, 1 << 16)]) == [None]
        assert bytes(b.memoryview(region)) == bytes(a.memoryview(src))
        assert a.stats()["shm" if backend == "memfd" else "tcp"]["bytes"] == 1 << 16
        b.unregister(region)
    if backend == "posix":
        assert not os.path.exists(path)


@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_alloc_shared_commits_its_pages_up_front(backend):
    """The owner's shared memory is populated at allocation (no page fault on the first copy into it): the
    file's blocks are all allocated before anything is written."""
    m = shmem.allocate(8 << 20, backend)
    try:
        if shmem.populate_pages(m.addr, 4096):  # the kernel has MADV_POPULATE_WRITE (Linux >= 5.14)
            assert os.stat(m.path).st_blocks * 512 >= 8 << 20
        assert not m.array.any()
    finally:
        m.close()


def test_no_common_transport_fails_with_reason():
    with TransferEngine(TransferConfig(transports="shm")) as a, TransferEngine(TransferConfig(transports="tcp")) as b:
        region = b.alloc_shared(4096)
        src = a.register(bytearray(8))
        st = a.batch_write([TransferRequest(src, 0, b.descriptor(), region.region_id, 0, 8)])
    assert isinstance(st[0], TransferFailed) and "no common transport" in str(st[0])


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"transports": "udp"}, "transports"),
        ({"transports": "tcp,tcp"}, "transports"),
        ({"transports": ""}, "transports"),
        ({"tcp_connections": 0}, "tcp_connections"),
        ({"max_frame": 1000}, "max_frame"),
        ({"timeout_ms": 0}, "timeout_ms"),
        ({"tcp_port": 70000}, "tcp_port"),
        ({"shm_backend": "sysv"}, "shm_backend"),
    ],
)
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ConfigError, match=match):
        TransferConfig(**kw)


def test_config_accepts_size_strings():
    assert TransferConfig(max_frame="4MiB").max_frame == 4 << 20
    with pytest.raises(ConfigError, match="byte size"):
        TransferConfig(max_frame="lots")


def test_config_from_env():
    cfg = load(TransferConfig, environ={"KVPLUGINS_TRANSFER_MAX_FRAME": "4MiB", "KVPLUGINS_TRANSFER_TRANSPORTS": "tcp"})
    assert cfg.max_frame == 4 << 20 and cfg.transport_list() == ["tcp"]


def test_bad_timeout_argument_is_rejected(eng):
    with pytest.raises(ValueError, match="timeout_ms"):
        eng.batch_read([], timeout_ms=-1)


def test_close_is_idempotent_and_import_stays_torch_free():
    e = TransferEngine(TransferConfig())
    e.close()
    e.close()
    code = "import sys, kvplugins.transfer; print('torch' in sys.modules, 'zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_unregister_and_close_during_transfers_never_crash(transport):
    """Memory in flight is pinned: racing unregister()/close() against batches gives per-entry errors
    (or success), never a crash or a hang."""
    import threading

    cfg = TransferConfig(transports=transport, timeout_ms=2000)
    with TransferEngine(cfg) as a, TransferEngine(cfg) as b:
        remote = b.alloc_shared(1 << 20)
        desc = b.descriptor()
        src = a.alloc_shared(1 << 20, export=False)
        view = b.memoryview(remote)
        results, stop = [], threading.Event()

        def pound():
            while not stop.is_set():
                req = TransferRequest(src, 0, desc, remote.region_id, 0, 1 << 20)
                results.extend(a.batch_write([req]))

        threads = [threading.Thread(target=pound) for _ in range(2)]
        for t in threads:
            t.start()
        b.unregister(remote)
        view[0] = 1  # the view taken before unregister still points at live memory
        a.unregister(src)
        stop.set()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
    assert results and all(e is None or isinstance(e, (OutOfRange, TransferFailed)) for e in results)


@pytest.mark.parametrize("endpoint", [{"host": "127.0.0.1"}, {"host": 5, "port": 80}, {"host": "h", "port": True}, "x"])
def test_malformed_tcp_endpoint_is_no_route_not_a_crash(endpoint):
    import dataclasses

    with TransferEngine(TransferConfig(transports="tcp")) as a, TransferEngine(TransferConfig(transports="tcp")) as b:
        region = b.alloc_shared(4096)
        bad = dataclasses.replace(b.descriptor(), transports={"tcp": endpoint})
        st = a.batch_write([TransferRequest(a.register(bytearray(8)), 0, bad, region.region_id, 0, 8)])
    assert isinstance(st[0], TransferFailed) and "no common transport" in str(st[0])


def test_read_only_memory_is_a_source_never_a_destination():
    with TransferEngine(TransferConfig(transports="tcp")) as a, TransferEngine(TransferConfig(transports="tcp")) as b:
        data = bytes(range(256)) * 16
        src = a.register(data)
        assert src.readonly and a.memoryview(src).readonly
        shared = b.alloc_shared(8192)
        frozen = np.arange(100, dtype=np.uint8)
        frozen.flags.writeable = False
        exported_ro = b.register(frozen, export=True)
        d = b.descriptor()
        st = a.batch_write(
            [
                TransferRequest(src, 0, d, shared.region_id, 0, 4096),
                TransferRequest(src, 0, d, exported_ro.region_id, 0, 10),
            ]
        )
        assert st[0] is None and bytes(b.memoryview(shared)[:4096]) == data
        assert isinstance(st[1], OutOfRange) and "read-only" in str(st[1])
        assert list(frozen[:10]) == list(range(10))  # untouched
        rd = a.batch_read([TransferRequest(src, 0, d, shared.region_id, 0, 16)])
        assert isinstance(rd[0], OutOfRange) and "read-only" in str(rd[0])
        dst = a.register(bytearray(10))
        assert a.batch_read([TransferRequest(dst, 0, d, exported_ro.region_id, 0, 10)]) == [None]
        assert bytes(a.memoryview(dst)) == bytes(range(10))
    assert data == bytes(range(256)) * 16


def test_a_region_read_only_to_peers_says_so_in_the_descriptor_and_the_master_schema_keeps_it(eng):
    import msgspec

    from kvplugins.store.wire.schema import Descriptor

    guarded = eng.register(bytearray(64), export=True, peer_readonly=True)
    plain = eng.register(bytearray(64), export=True)
    d = eng.descriptor()
    assert d.region(guarded.region_id).readonly and not d.region(plain.region_id).readonly
    wire = msgpack.unpackb(msgpack.packb(d.to_wire()))
    assert SegmentDescriptor.from_wire(wire) == d
    checked = msgspec.msgpack.decode(msgpack.packb(wire), type=Descriptor).wire()
    assert SegmentDescriptor.from_wire(checked) == d
    src = eng.register(bytearray(64))
    [err] = eng.batch_write([TransferRequest(src, 0, d, guarded.region_id, 0, 64)])
    assert isinstance(err, OutOfRange) and "read-only to peers" in str(err)
    [err] = eng.write_spans(d, guarded.region_id, [src.addr], [0], [64])
    assert isinstance(err, OutOfRange)
