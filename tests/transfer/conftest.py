"""Shared fixtures: a real peer process per transport (module scope) and a local engine per test.

KVPLUGINS_TEST_TRANSPORTS (default "shm,cma,tcp") picks the transports the suite is parametrized over; the RDMA
guest (tests/rdma/test_guest.py) runs it with "rdma,tcp,shm" on a soft-RoCE device. "rdma" runs with TCP
configured beside it (its connection set-up path), and each test then checks that RDMA carried its entries:
the engine has the transport and nothing fell back to TCP.
"""

import os

import pytest

from helpers.peer import Peer
from kvplugins.transfer import TransferConfig, TransferEngine

TRANSPORTS = os.environ.get("KVPLUGINS_TEST_TRANSPORTS", "shm,cma,tcp").split(",")
CONFIG = {"shm": "shm", "cma": "cma", "tcp": "tcp", "rdma": "rdma,tcp"}
PEER_SIZE = 80 << 20


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def peer(transport):
    with Peer(transports=CONFIG[transport], size=PEER_SIZE, seed=11) as p:
        yield p


@pytest.fixture
def engine(transport):
    eng = TransferEngine(TransferConfig(transports=CONFIG[transport], timeout_ms=30000))
    yield eng
    stats = eng.stats()
    eng.close()
    if transport == "rdma":
        assert "rdma" in stats, "the RDMA transport did not start (no usable device?)"
        assert not stats["fallbacks"], f"entries fell back from RDMA: {stats['fallbacks']}"
