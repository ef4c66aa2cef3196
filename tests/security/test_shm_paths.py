"""Issue #30 item 1 on real processes: a node-role peer registers a segment whose descriptor names a regular file
(with this host's id and a live pid) as its shared memory, or serves an fd socket that hands out a regular
file's fd. Nobody opens the named path and the handed fd is refused (transfer/fdpass.py): the master's
admission probe fails, naming why, so the segments are never placed on (master/admission.py); the file is
untouched and puts land. With the probe off, clients refuse the same way: every put placed there fails naming
why and writes nothing."""

import array
import hashlib
import os
import socket
import threading

import pytest
from helpers.cluster import store_cluster
from kvplugins.cli.status import fetch as status_fetch
from kvplugins.errors import KVPluginsError
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.placement import PutConfig
from kvplugins.store.wire.protocol import OK, UNREACHABLE
from kvplugins.store.client.connect import control_client
from kvplugins.transfer import fdpass


def _serve_regular_file(name: str, path: str, stop: threading.Event) -> threading.Thread:
    """An fd socket, as fdpass.FdServer's, that hands out an fd of the regular file ``path`` for any region."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + name)
    srv.listen(8)
    srv.settimeout(0.2)

    def run():
        with srv:
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except socket.timeout:
                    continue
                with conn, open(path, "r+b") as f:
                    try:
                        conn.recv(8)
                        conn.sendmsg(
                            [(1 << 30).to_bytes(8, "little")],
                            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [f.fileno()]))],
                        )
                    except OSError:  # the client hung up first (it refused this server)
                        pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def status(master: str) -> dict:
    return status_fetch(master, 3000)


def _bogus_segments(node, real: dict, victim: str, fd_name: str) -> list:
    """Register two 1 GiB segments naming ``victim`` as their memory (one without an fd socket, one whose fd
    socket hands out the file's fd); the per-entry answers."""
    out = []
    for i, shm in enumerate([{"pid": os.getpid()}, {"pid": os.getpid(), "fd_socket": fd_name}]):
        bogus = {
            "v": 1,
            "segment_id": f"attacker-{i}",
            "host_id": real["host_id"],
            "transports": {"shm": shm},
            "regions": [[1, 1 << 30, victim]],
        }
        [answer] = node.call("register_segment", [[bogus, 1, 1 << 30]], {"owner": f"attacker-{i}"})
        out.append(answer)
    return out


@pytest.mark.parametrize("probe_ms", [5000, 0], ids=["admission-probe", "probe-off"])
def test_a_segment_naming_a_file_never_gets_it_written(tmp_path, probe_ms):
    victim = tmp_path / "victim"
    victim.write_bytes(os.urandom(1 << 20))
    before = hashlib.sha256(victim.read_bytes()).hexdigest()
    fd_name = f"kvp-fd-{os.getpid()}-{os.urandom(8).hex()}"
    stop = threading.Event()
    server = _serve_regular_file(fd_name, str(victim), stop)
    with (
        store_cluster(nodes=1, segment_size="8MiB", master_flags={"admission_probe_ms": probe_ms}) as c,
        StoreClient(ClientConfig(master=c.master, rpc_timeout_ms=3000, transfer_timeout_ms=2000)) as client,
    ):
        node = control_client(c.master, 3000, "node")  # the attacker holds a node credential
        try:
            [(code, real)] = node.call("describe", [c.nodes[0].address])
            assert code == OK
            answers = _bogus_segments(node, real, str(victim), fd_name)
            if probe_ms:
                assert [code for code, _ in answers] == [UNREACHABLE, UNREACHABLE]
                assert "no common transport" in answers[0][1] and "not memory sealed" in answers[1][1]
                assert [s["name"] for s in status(c.master)["segments"]] == [c.nodes[0].address]
                for i in range(40):
                    client.put(f"victim/{i}", os.urandom(4096))  # placement never saw them
            else:
                assert [code for code, _ in answers] == [OK, OK]  # the biggest segments: placement picks them
                names, errors = [name for _, name in answers], []
                for i in range(40):
                    with pytest.raises(KVPluginsError) as err:
                        client.put(f"victim/{i}", os.urandom(4096), PutConfig(preferred_segment=names[i % 2]))
                    errors.append(str(err.value))
                assert any("no common transport" in e for e in errors)  # no fd socket: shm cannot reach it
                assert any("not memory sealed" in e for e in errors)  # a regular file's fd: refused
                for i, name in enumerate(names):
                    assert node.call("unregister", [name], {"owner": f"attacker-{i}"}) == [[OK, None]]
            assert hashlib.sha256(victim.read_bytes()).hexdigest() == before
            client.put("victim/after", b"v" * 4096)
            assert client.get("victim/after") == b"v" * 4096
        finally:
            stop.set()
            server.join(5)
            node.close()


def test_fetch_refuses_what_is_not_sealed_shared_memory(tmp_path):
    """fdpass.fetch: a regular file's fd, a socket served by another pid than claimed, a malformed name and an
    unknown region are each refused naming why; a real FdServer's sealed memfd maps."""
    from kvplugins.errors import TransferFailed
    from kvplugins.transfer import shmem

    path = tmp_path / "plain"
    path.write_bytes(bytes(4096))
    name, stop = f"kvp-fd-{os.getpid()}-{os.urandom(8).hex()}", threading.Event()
    t = _serve_regular_file(name, str(path), stop)
    try:
        with pytest.raises(TransferFailed, match="not memory sealed"):
            fdpass.fetch(name, os.getpid(), 1, 4096)
        with pytest.raises(TransferFailed, match=f"served by pid {os.getpid()}"):
            fdpass.fetch(name, 1, 1, 4096)
    finally:
        stop.set()
        t.join(5)
    with pytest.raises(TransferFailed, match="names no fd socket"):
        fdpass.fetch("../../etc/passwd", os.getpid(), 1, 4096)
    mem, srv = shmem.allocate(8192), fdpass.FdServer()
    try:
        srv.offer(7, mem.fd, 8192)
        with pytest.raises(TransferFailed, match="handed no shared memory for region 8"):
            fdpass.fetch(srv.name, os.getpid(), 8, 8192)
        with pytest.raises(TransferFailed, match="descriptor says 16384"):
            fdpass.fetch(srv.name, os.getpid(), 7, 16384)
        mem.array[:4] = [1, 2, 3, 4]
        peer = shmem.map_fd(fdpass.fetch(srv.name, os.getpid(), 7, 8192), 8192, "test")
        assert bytes(peer.array[:4]) == b"\x01\x02\x03\x04"
        peer.close()
    finally:
        srv.close()
        mem.close()
