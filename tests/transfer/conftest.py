"""Shared fixtures: a real peer process per transport (module scope) and a local engine per test."""
import pytest

from helpers.peer import Peer
from kvplugins.transfer import TransferConfig, TransferEngine

TRANSPORTS = ["shm", "tcp"]
PEER_SIZE = 80 << 20


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def peer(transport):
    with Peer(transports=transport, size=PEER_SIZE, seed=11) as p:
        yield p


@pytest.fixture
def engine(transport):
    eng = TransferEngine(TransferConfig(transports=transport, timeout_ms=5000))
    yield eng
    eng.close()
