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
