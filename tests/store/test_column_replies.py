"""Big batches (more than transfer.spans.SMALL keys) take the column form of the master's get reply and the
numpy span planning: misses, size mismatches and unregistered spans are reported per key next to exact
bytes, and objects with two replicas fall back to the per-key path (replica retry kept)."""

import numpy as np

from kvplugins.errors import BufferNotRegistered, KeyNotFound, SizeMismatch
from kvplugins.store import ClientConfig, StoreClient


def test_big_get_batch_reports_each_key(client, put_pages):
    n, size = 40, 3000
    src, dst, b, keys = put_pages(client, "cr", n, size, seed=6)
    asked = keys[:30] + ["cr/missing"] + keys[30:]
    spans = [[(b + i * size, size)] for i in range(30)] + [[(b, 10)]] + [[(b + i * size, size)] for i in range(30, n)]
    spans[3] = [(b + 3 * size, size - 1)]  # wrong total: SizeMismatch
    spans[5] = [(np.zeros(8, np.uint8).ctypes.data, size)]  # not registered
    out = client.batch_get_into(asked, spans)
    assert isinstance(out[30], KeyNotFound) and isinstance(out[3], SizeMismatch)
    assert isinstance(out[5], BufferNotRegistered)
    good = [i for i in range(n) if i not in (3, 5)]
    assert all(out[i if i < 30 else i + 1] is None for i in good)
    for i in good:
        assert np.array_equal(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size])


def test_big_get_batch_of_two_replica_objects(cluster, put_pages):
    with StoreClient(ClientConfig(master=cluster.master, replicas=2)) as c:
        n, size = 20, 5000
        src, dst, b, keys = put_pages(c, "cr2", n, size, seed=7)
        assert (
            c.batch_get_into(keys, [[(b + i * size, 2000), (b + i * size + 2000, 3000)] for i in range(n)])
            == [None] * n
        )
        assert np.array_equal(dst, src)
