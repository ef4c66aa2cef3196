"""Mooncake's Transfer Engine API with CUDA memory (issue #36): ``register_memory`` of a CUDA tensor's pointer
(location "*", found by cudaPointerGetAttributes, as vLLM's MooncakeConnector and SGLang's P/D register their
KV caches) is served to peers over TCP with cudaMemcpy around each frame, and its owner's own transfers stage it
through host memory. On CPU the same paths run with the device emulated (tests/mooncake/test_mooncake_te.py,
tests/transfer/test_device_memory.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvplugins.mooncake import te

torch = pytest.importorskip("torch")


@pytest.fixture
def engines():
    a, b = te.TransferEngine(), te.TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield a, b
    a.close()
    b.close()


def test_a_cuda_buffer_is_read_and_written_by_a_peer_and_by_its_owner(engines):
    a, b = engines
    kv = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)  # 4 MiB of device memory
    host = np.zeros(1 << 22, np.uint8)
    assert a.register_memory(host.ctypes.data, host.nbytes) == 0
    assert b.register_memory(kv.data_ptr(), kv.numel()) == 0  # "*": detected as device memory
    b_name, a_name = f"127.0.0.1:{b.get_rpc_port()}", f"127.0.0.1:{a.get_rpc_port()}"
    torch.cuda.synchronize()
    assert a.transfer_sync_read(b_name, host.ctypes.data, kv.data_ptr() + 4096, 1 << 20) == 0
    assert np.array_equal(host[: 1 << 20], kv[4096 : 4096 + (1 << 20)].cpu().numpy())
    host[:65536] = 0xAB
    assert a.transfer_sync_write(b_name, host.ctypes.data, kv.data_ptr(), 65536) == 0
    assert bool((kv[:65536] == 0xAB).all())
    assert b.stats()["tcp"]["server_staged_bytes"] == (1 << 20) + 65536
    host[:] = 0
    assert b.transfer_sync_write(a_name, kv.data_ptr(), host.ctypes.data + 8, 1 << 21) == 0  # owner -> peer
    assert np.array_equal(host[8 : 8 + (1 << 21)], kv[: 1 << 21].cpu().numpy())
    kv.zero_()
    torch.cuda.synchronize()
    assert b.transfer_sync_read(a_name, kv.data_ptr() + 100, host.ctypes.data + 8, 1 << 20) == 0  # peer -> owner
    assert np.array_equal(kv[100 : 100 + (1 << 20)].cpu().numpy(), host[8 : 8 + (1 << 20)])
    assert b.unregister_memory(kv.data_ptr()) == 0
