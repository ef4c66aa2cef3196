"""Issue #30's attacks on real processes, asserting the new behaviour:

* segment hijack: re-registering (or unregistering) a node's live segment name from another process is refused,
  and every acknowledged object on it stays readable;
* remove_by_regex: a pattern compiling to a huge RE2 program is refused; one at the limit, over keys of 4 KiB,
  runs in slices while another client's ops each wait < 100 ms, and SIGTERM still stops the master within 1 s;
* lockout: 1,100 idle unauthenticated connections from 127.0.0.1 and 1,000 more over 127.0.0.2-6 do not keep a
  new authenticated client out.
"""

import os
import signal
import socket
import threading
import time

import pytest

from helpers.cluster import master_process, store_cluster
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.master.admin_ops import MAX_PROGRAM
from kvplugins.store.wire.protocol import EXISTS, INVALID, OK
from kvplugins.store.client.rpc import RawRpcClient
from kvplugins.store.client.connect import control_client


def test_a_live_segment_name_cannot_be_hijacked():
    with store_cluster(nodes=1, segment_size="8MiB") as c:
        client = StoreClient(ClientConfig(master=c.master, rpc_timeout_ms=3000))
        node = control_client(c.master, 3000, "node")  # a node-role peer that is not that node
        try:
            data = {f"hijack/{i}": os.urandom(4096) for i in range(50)}
            for k, v in data.items():
                client.put(k, v)
            name = c.nodes[0].address
            [(code, desc)] = node.call("describe", [name])
            assert code == OK
            bogus = dict(desc, regions=[[desc["regions"][0][0], 1 << 20, "/tmp/victim-file"]])
            [(code, why)] = node.call(
                "register_segment", [[bogus, desc["regions"][0][0], 1 << 20]], {"owner": "attacker"}
            )
            assert code == EXISTS and "registered by another process" in why
            [(code, why)] = node.call("unregister", [name], {"owner": "attacker"})
            assert code == EXISTS
            [(code, why)] = node.call("unregister", [name])
            assert code == EXISTS
            st = node.call("status")
            [seg] = st["segments"]
            assert seg["name"] == name and seg["size"] == 8 << 20
            assert all(client.get(k) == v for k, v in data.items())  # 50 of 50 intact
            client.put("hijack/after", b"x" * 4096)  # and puts still land
            assert client.get("hijack/after") == b"x" * 4096
        finally:
            node.close()
            client.close()


def _fill(rpc: RawRpcClient, n: int, key_bytes: int) -> None:
    """``n`` committed 1-byte objects with keys of ``key_bytes`` bytes of 'ab' (what the patterns chew on)."""
    keys = [f"{i:08d}" + "ab" * ((key_bytes - 8) // 2) for i in range(n)]
    for j in range(0, n, 512):
        part = keys[j : j + 512]
        assert all(code == OK for code, _ in rpc.call("put_start", [[k, 1] for k in part], {}))
        rpc.call("put_commit", part, {})


@pytest.mark.slow
def test_remove_by_regex_never_stalls_the_master(tmp_path):
    with store_cluster(nodes=1, segment_size="8MiB", tmp=tmp_path) as c:
        admin = RawRpcClient(c.master, 60000, "admin")
        other = RawRpcClient(c.master, 3000)
        try:
            [(code, why)] = [admin.call("remove_by_regex", ["(ab|ba){1000}zz"], {})]
            assert code == INVALID and f"limit of {MAX_PROGRAM}" in why
            _fill(other, 4096, 4096)
            waits, done = [], threading.Event()
            result = {}

            def scan():
                result["r"] = admin.call("remove_by_regex", ["(ab|ba){330}zz"], {})  # ~1,990 instructions
                done.set()

            t = threading.Thread(target=scan)
            t.start()
            while not done.is_set():
                t0 = time.perf_counter()
                other.call("exists", ["00000001"])
                waits.append(time.perf_counter() - t0)
            t.join()
            assert result["r"] == [OK, 0]
            assert len(waits) >= 3 and max(waits) < 0.1, (len(waits), max(waits))
            # SIGTERM in the middle of a scan: the master exits within 1 s
            threading.Thread(
                target=lambda: _ignore(admin.call, "remove_by_regex", ["(ab|ba){330}zz"], {}), daemon=True
            ).start()
            time.sleep(0.5)
            t0 = time.monotonic()
            c.master_proc.popen.send_signal(signal.SIGTERM)
            c.master_proc.popen.wait(timeout=10)
            assert time.monotonic() - t0 < 1.0
        finally:
            admin.close()
            other.close()


def _ignore(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the master is being stopped under it
        pass


@pytest.mark.slow
def test_idle_unauthenticated_connections_lock_nobody_out():
    with master_process() as m:
        host, port = m.address.rsplit(":", 1)
        idle = []
        try:
            for i in range(1100):
                idle.append(socket.create_connection((host, int(port)), timeout=5))
            for src in range(2, 7):
                for _ in range(200):
                    s = socket.socket()
                    s.bind((f"127.0.0.{src}", 0))
                    s.connect((host, int(port)))
                    idle.append(s)
            t0 = time.monotonic()
            rpc = RawRpcClient(m.address, 3000)
            try:
                assert "zmq" in rpc.call("info")
            finally:
                rpc.close()
            assert time.monotonic() - t0 < 1.0
        finally:
            for s in idle:
                s.close()
