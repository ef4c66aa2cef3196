"""Package-level promises: cheap import, the error hierarchy, the native copy path."""
import subprocess
import sys

import numpy as np
import pytest

from kvplugins import errors, native


def test_import_is_cheap_and_torch_free():
    code = ("import sys,time; t=time.perf_counter(); import kvplugins; dt=time.perf_counter()-t; "
            "print(dt, 'torch' in sys.modules, 'zmq' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) <= 0.3
    assert out[1:] == ["False", "False"]


def test_every_error_derives_from_the_base():
    names = [n for n in dir(errors) if isinstance(getattr(errors, n), type) and issubclass(getattr(errors, n), Exception)]
    assert len(names) > 10
    assert all(issubclass(getattr(errors, n), errors.KVPluginsError) for n in names)


def test_master_unreachable_names_address_and_timeout():
    e = errors.MasterUnreachable("127.0.0.1:5555", 250)
    assert "127.0.0.1:5555" in str(e) and "250 ms" in str(e)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n, size", [(1, 1), (3, 4099), (64, 300_000)])
def test_native_copy_batch_is_exact(threads, n, size):
    rng = np.random.default_rng(n * size)
    src = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    dst = [np.zeros(size, np.uint8) for _ in range(n)]
    native.copy_batch([d.ctypes.data for d in dst], [s.ctypes.data for s in src], [size] * n, threads=threads)
    assert all(np.array_equal(d, s) for d, s in zip(dst, src))


def test_native_copy_batch_rejects_ragged_input():
    with pytest.raises(errors.NativeError, match="differ in length"):
        native.copy_batch([1, 2], [1], [1, 1])
