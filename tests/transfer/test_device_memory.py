"""Device memory in the transfer core (kvplugins/transfer/device.py, issue #36): a region registered with
``device=`` is reached by peers over TCP only, its owner's native server staging each frame through host memory
with the device's copy functions; the owner's own batches refuse it as a local span. The device is emulated
(host memory copied only by native functions with cudaMemcpy's signature): this machine has no GPU;
tests/gpu/ runs the Mooncake TE path with CUDA memory where one is lent."""

from __future__ import annotations

import numpy as np
import pytest

from kvplugins.errors import OutOfRange
from kvplugins.transfer import TransferConfig, TransferEngine, TransferRequest, device


@pytest.fixture
def engines():
    a = TransferEngine(TransferConfig(timeout_ms=10000))
    b = TransferEngine(TransferConfig(timeout_ms=10000))
    yield a, b
    a.close()
    b.close()


def test_peers_reach_a_device_region_over_tcp_only_staged_by_its_server(engines):
    a, b = engines
    mem = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)  # the "device" memory
    dev = b.register(mem.ctypes.data, mem.nbytes, export=True, device=device.emulated(0))
    info = b.descriptor().region(dev.region_id)
    assert info.addr is None and info.rdma is None and info.shm_path is None  # no one-sided path into it
    src = np.full(300_000, 9, np.uint8)
    a.register(src)
    remote = b.descriptor()
    offs = [0, 400_000, 900_000]
    status = a.write_spans(remote, dev.region_id, [src.ctypes.data] * 3, offs, [100_000, 300_000, 50_000])
    assert status == [None, None, None]
    assert (mem[:100_000] == 9).all() and (mem[400_000:700_000] == 9).all() and (mem[900_000:950_000] == 9).all()
    assert mem[100_000] == np.uint8(100_000 % 256)
    dst = np.zeros(200_000, np.uint8)
    a.register(dst)
    assert a.read_spans(remote, dev.region_id, [dst.ctypes.data], [650_000], [200_000]) == [None]
    assert np.array_equal(dst, mem[650_000:850_000])
    stats = a.stats()
    assert stats["tcp"]["entries"] == 4 and stats["cma"]["entries"] == 0 and stats["shm"]["entries"] == 0
    assert b.stats()["tcp"]["server_staged_bytes"] == 450_000 + 200_000


def test_a_device_region_is_never_a_local_span(engines):
    a, b = engines
    host = np.zeros(4096, np.uint8)
    remote_region = b.register(host, export=True)
    mem = np.ones(4096, np.uint8)
    dev = a.register(mem.ctypes.data, mem.nbytes, device=device.emulated(0))
    remote = b.descriptor()
    [status] = a.batch_write([TransferRequest(dev, 0, remote, remote_region.region_id, 0, 4096)])
    assert isinstance(status, OutOfRange) and "device memory" in str(status)
    [status] = a.write_spans(remote, remote_region.region_id, [mem.ctypes.data], [0], [4096])
    assert isinstance(status, OutOfRange) and not host.any()  # not registered host memory: nothing moved
    with pytest.raises(TypeError, match="int address"):
        a.register(mem, device=device.emulated(0))


def test_locations_name_host_or_device_memory():
    buf = np.zeros(64, np.uint8)
    assert device.for_location("cpu:0", buf.ctypes.data, emulate=False) is None
    assert device.for_location("*", buf.ctypes.data, emulate=False) is None  # no CUDA runtime loaded: host
    assert device.for_location("cuda:1", buf.ctypes.data, emulate=True).index == 1
    with pytest.raises(Exception, match="location 'npu:0'"):
        device.for_location("npu:0", buf.ctypes.data, emulate=True)
