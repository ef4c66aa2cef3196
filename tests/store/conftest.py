import pytest

from helpers.cluster import store_cluster


@pytest.fixture(scope="module")
def cluster():
    """One master + two 16 MiB store nodes shared by a test module (tests use distinct key prefixes)."""
    with store_cluster(nodes=2, segment_size="16MiB") as c:
        yield c


@pytest.fixture
def client(cluster):
    from kvplugins.store import ClientConfig, StoreClient

    c = StoreClient(ClientConfig(master=cluster.master, rpc_timeout_ms=3000))
    yield c
    c.close()


@pytest.fixture
def put_pages():
    """put_pages(client, prefix, n, size, seed) -> (src, dst, dst address, keys): n random pages of ``size``
    bytes put from one registered buffer (asserted to succeed), and a registered zeroed buffer to read into."""
    import numpy as np

    def put(client, prefix: str, n: int, size: int, seed: int):
        src = np.random.default_rng(seed).integers(0, 256, n * size, dtype=np.uint8)
        dst = np.zeros_like(src)
        a, b = client.register_buffer(src).addr, client.register_buffer(dst).addr
        keys = [f"{prefix}/{i}" for i in range(n)]
        assert client.batch_put_from(keys, [[(a + i * size, size)] for i in range(n)]) == [None] * n
        return src, dst, b, keys

    return put
