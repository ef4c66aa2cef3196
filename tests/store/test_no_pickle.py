"""No pickle on any wire. (1) The package never imports a pickle-family module nor calls a pickling API (an AST
scan: every wire of kvplugins is msgpack or raw bytes). (2) A pickle whose unpickling would create a file is
fed to a real master (raw RPC and zmq endpoints, with and without a shared secret) and to a transfer server:
each refuses it (connection closed or message dropped), the file never appears, and the server keeps serving."""

import ast
import pickle
import socket
import struct
from pathlib import Path

import numpy as np
import pytest

import kvplugins
from helpers.auth import authenticated, read_until_closed, use_secret
from helpers.cluster import master_process
from kvplugins.store.client.rpc import RawRpcClient
from kvplugins.store.client.connect import control_client
from kvplugins.transfer import TransferConfig, TransferEngine

FORBIDDEN_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "cloudpickle",
    "dill",
    "marshal",
    "shelve",
    "joblib",
    "copyreg",
    "multiprocessing",
}  # multiprocessing connections and queues pickle what they carry
FORBIDDEN_CALLS = {
    "recv_pyobj",
    "send_pyobj",
    "recv_serialized",
    "send_serialized",
    "read_pickle",
    "to_pickle",
    "loads_pickle",
}
SECRET = "pickle-test-secret-" + "0f" * 16


def _violations(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        out += [f"{path}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in FORBIDDEN_MODULES]
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_CALLS:
            out.append(f"{path}:{node.lineno} uses {node.attr}")
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "load"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            out.append(f"{path}:{node.lineno} uses torch.load (pickle)")
        if (
            isinstance(node, ast.keyword)
            and node.arg == "allow_pickle"
            and not (isinstance(node.value, ast.Constant) and node.value.value is False)
        ):
            out.append(f"{path}:{node.lineno} passes allow_pickle")
    return out


def test_the_package_never_pickles():
    files = sorted(Path(kvplugins.__file__).parent.rglob("*.py"))
    assert len(files) > 50
    bad = [v for f in files for v in _violations(f)]
    assert not bad, "pickle-family use in kvplugins (every wire must be msgpack or raw bytes):\n" + "\n".join(bad)


def test_the_scan_finds_pickle(tmp_path):
    sample = tmp_path / "bad.py"
    sample.write_text(
        "import pickle\nfrom multiprocessing import connection\nsock.recv_pyobj()\n"
        "torch.load(f)\nnp.load(f, allow_pickle=True)\n"
    )
    assert len(_violations(sample)) == 5


class _Trap:
    """Unpickling this creates ``path``: proof that someone unpickled it."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _refused(address: tuple[str, int], data: bytes, role: str | None = None) -> bool:
    """Send ``data`` on a fresh connection (authenticated as ``role`` first, if given); True when the server
    closes it without answering a frame (an authentication refusal is the only answer allowed)."""
    with socket.create_connection(address, timeout=5) as s:
        if role is not None:
            authenticated(s, role)
        s.sendall(data)
        got = read_until_closed(s)
    return got == b"" or got[:4] == b"KVPA"


@pytest.fixture(params=[None, SECRET], ids=["per-user-secret", "secret"])
def trap(request, tmp_path, monkeypatch):
    """(path, pickle payload whose unpickling creates path), under no secret or SECRET."""
    use_secret(monkeypatch, request.param)
    path = tmp_path / "unpickled"
    return path, pickle.dumps(_Trap(path), protocol=pickle.HIGHEST_PROTOCOL)


def test_master_refuses_pickle(tmp_path, trap):
    trap, payload = trap
    with master_process(tmp=tmp_path / "m") as m:
        host, port = m.address.rsplit(":", 1)
        for role in (None, "admin"):  # unauthenticated, and past the handshake
            assert _refused((host, int(port)), struct.pack(">I", len(payload)) + payload, role)  # framed
            assert _refused((host, int(port)), payload, role)  # bare
        ctl = control_client(m.address, 3000)
        endpoint = ctl.address
        ctl.close()
        import zmq

        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            dealer.send(payload)
            assert not dealer.poll(700)  # dropped (or never accepted under CURVE): no answer
        rpc = RawRpcClient(m.address, 3000)
        assert "zmq" in rpc.call("info")  # still serving
        rpc.close()
        assert m.alive()
    assert not trap.exists()


def test_transfer_server_refuses_pickle(trap):
    trap, payload = trap
    eng = TransferEngine(TransferConfig(transports="tcp"))
    try:
        region = eng.alloc_shared(1 << 16)
        ep = eng.descriptor().transports["tcp"]
        for role in (None, "data"):
            assert _refused((ep["host"], ep["port"]), payload, role)
            assert _refused((ep["host"], ep["port"]), b"KVPT" + struct.pack("<IQ", len(payload), 0) + payload, role)
        assert not np.frombuffer(eng.memoryview(region), np.uint8).any()
    finally:
        eng.close()
    assert not trap.exists()
