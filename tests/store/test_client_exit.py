"""A process that never closes its store client exits 0 and silently: at exit the transfer engines left open are
closed (their native server threads joined, native objects freed) before the interpreter finalizes. Before,
nanobind printed "leaked instance ... kvplugins._tcp.Server" on stderr at every such exit (and over pyverbs an
RDMA client aborted). Real master and node processes; parametrized over the transports a client offers."""

import subprocess
import sys

import pytest

from helpers.cluster import store_cluster

SCRIPT = """
import sys
import weakref
import numpy as np
class Engine:  # an engine (vLLM) whose finalizer closes the client at exit, after kvplugins closed the engines
    pass
weakref.finalize(Engine(), print)  # registers weakref's exit hook first, so kvplugins' runs before it
from kvplugins.store import ClientConfig, StoreClient
client = StoreClient(ClientConfig(master=sys.argv[1], transports=sys.argv[2]))
owner = Engine()
weakref.finalize(owner, client.close) if len(sys.argv) > 3 else None
pages = [np.random.default_rng(i).bytes(1 << 20) for i in range(8)]
keys = [f"exit/{sys.argv[2]}/{i}" for i in range(8)]
assert client.batch_put(keys, pages) == [None] * 8
assert client.batch_get(keys) == pages
assert client.transfer_stats()[sys.argv[2].split(",")[0]]["bytes"] >= 8 << 20
print("ok")
"""


@pytest.fixture(scope="module")
def cluster():
    with store_cluster(nodes=1, segment_size="64MiB", node_flags={"transports": "shm,tcp"}) as c:
        yield c


@pytest.mark.parametrize("closed_by", ["nobody", "a finalizer at exit"])
@pytest.mark.parametrize("transports", ["tcp", "shm,tcp"])
def test_a_client_left_open_exits_0_and_silently(cluster, transports, closed_by):
    """Left open, or closed by its owner's finalizer after kvplugins closed its engine at exit (vLLM's engine
    shuts the connector down from a weakref finalizer: the client's close then unregistered a region of the
    closed engine and printed a BufferNotRegistered traceback)."""
    args = [sys.executable, "-c", SCRIPT, cluster.master, transports] + (["owner"] if closed_by != "nobody" else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, "ok", ""), r
