"""Issue #30 item 3 on real processes: a node-role peer registers a 256 TiB segment that keeps the biggest free
space but that nobody can reach (its TCP endpoint answers nothing, or refuses). The master's admission probe
(master/admission.py) refuses it, naming why, while every other client is served; it never gets a placement,
so every normal put succeeds while its registration is pending and after."""

import socket
import threading
import time

from helpers.cluster import store_cluster
from kvplugins.cli.status import fetch
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.wire.protocol import UNREACHABLE
from kvplugins.store.client.connect import control_client

PROBE_MS = 2000


def _segment(host_id: str, port: int) -> dict:
    return {
        "v": 1,
        "segment_id": f"bogus-{port}",
        "host_id": host_id,
        "transports": {"tcp": {"host": "127.0.0.1", "port": port, "max_frame": 1 << 24}},
        "regions": [[1, 256 << 40, None]],
    }


def test_an_unreachable_segment_never_gets_a_put():
    silent = socket.socket()  # accepts, never answers: the probe runs to its deadline
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    with socket.socket() as s:  # nobody listens: refused at once
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with (
        store_cluster(nodes=1, segment_size="8MiB", master_flags={"admission_probe_ms": PROBE_MS}) as c,
        StoreClient(ClientConfig(master=c.master, rpc_timeout_ms=5000)) as client,
    ):
        node = control_client(c.master, 10_000, "node")
        answers, t0 = {}, time.monotonic()

        def register(port):
            [answers[port]] = node.call(
                "register_segment", [[_segment("elsewhere", port), 1, 256 << 40]], {"owner": f"attacker-{port}"}
            )

        registrar = threading.Thread(target=register, args=(silent.getsockname()[1],))
        registrar.start()
        waits = []
        while registrar.is_alive():  # the master serves others (placement included) while the probe waits
            t = time.monotonic()
            client.put(f"k/{len(waits)}", b"x" * 4096)
            client.remove(f"k/{len(waits)}")
            waits.append(time.monotonic() - t)
        registrar.join(PROBE_MS / 1000 + 10)
        assert answers, c.master_proc.log_tail()
        register(closed)
        node.close()
        silent.close()
        took = time.monotonic() - t0
        assert [answers[p][0] for p in answers] == [UNREACHABLE, UNREACHABLE]
        assert all("admission probe" in why and "--host" in why for _, why in answers.values())
        assert PROBE_MS / 1000 <= took < PROBE_MS / 1000 + 5
        assert len(waits) > 10 and max(waits) < 0.5, waits
        for i in range(50):
            client.put(f"after/{i}", b"y" * 4096)
        assert client.get("after/49") == b"y" * 4096
        st = fetch(c.master, 3000)
        assert [s["name"] for s in st["segments"]] == [c.nodes[0].address] and st["segments_refused"] == 2
