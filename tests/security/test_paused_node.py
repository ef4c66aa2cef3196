"""A paused node loses nothing (issue #30 item 7), with real processes and the default master configuration
(heartbeat timeout 2 s, suspect grace 30 s): one of two nodes is SIGSTOPped for 10 s (back within the grace:
it resumes) or 45 s (back after it: it is removed, then re-registers and its manifest brings its objects back)
while a writer keeps putting. Every acknowledged put reads back with its bytes afterwards, and no put fails
once the stopped node is suspect (master/liveness.py)."""

import random
import signal
import threading
import time

import pytest

from helpers.cluster import store_cluster
from kvplugins.cli.status import fetch
from kvplugins.errors import StoreError
from kvplugins.store import ClientConfig, StoreClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
VALUE = 16 << 10
SUSPECT_BY_S = 3.0  # heartbeat timeout 2 s + a sweep: the stopped node takes no placement after this


class Writer(threading.Thread):
    """Puts batches of 4 fresh keys every 50 ms until stopped; records what was acknowledged and when puts failed."""

    def __init__(self, client: StoreClient):
        super().__init__(daemon=True)
        self.client, self.stop = client, threading.Event()
        self.acked: dict[str, bytes] = {}
        self.failed_at: list[float] = []
        self.rng = random.Random(30)

    def run(self) -> None:
        i = 0
        while not self.stop.wait(0.05) and len(self.acked) < 2400:
            keys = [f"p/{i + j}" for j in range(4)]
            values = [self.rng.randbytes(VALUE) for _ in keys]
            i += 4
            for key, value, err in zip(keys, values, self.client.batch_put(keys, values)):
                if err is None:
                    self.acked[key] = value
                else:
                    self.failed_at.append(time.monotonic())


def status(master: str) -> dict:
    return fetch(master, 5000)


def wait_for(what: str, cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not seen within {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.parametrize("pause_s", [10, 45])
def test_paused_node_loses_no_acknowledged_object(pause_s):
    with store_cluster(nodes=2, segment_size="64MiB") as c, StoreClient(ClientConfig(master=c.master)) as client:
        writer = Writer(client)
        writer.start()
        time.sleep(2)
        victim = c.nodes[0]
        victim.popen.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(
            "the stopped segment suspect",
            lambda: any(s["suspect"] for s in status(c.master)["segments"]),
            SUSPECT_BY_S + 1,
        )
        time.sleep(max(0.0, stopped + pause_s - time.monotonic()))
        victim.popen.send_signal(signal.SIGCONT)
        wait_for(
            "the node back",
            lambda: (
                [s["suspect"] for s in status(c.master)["segments"]] == [False, False]
                and len(status(c.master)["segments"]) == 2
            ),
            10,
        )
        time.sleep(1)
        writer.stop.set()
        writer.join(30)
        st = status(c.master)
        assert st["evictions"] == 0 and st["segments_suspect"] == 1
        if pause_s > 32:  # past the grace: removed, then its manifest came back with it
            assert st["segments_lost"] == 1 and st["objects_restored"] > 0 and st["manifest_objects"] == 0
        else:
            assert st["segments_lost"] == 0 and st["objects_lost"] == 0
        assert [t for t in writer.failed_at if t > stopped + SUSPECT_BY_S] == []
        keys = sorted(writer.acked)
        assert len(keys) > 200 and all(n["objects"] > 0 for n in st["segments"])
        got = client.batch_get(keys)
        lost = [k for k, v in zip(keys, got) if isinstance(v, StoreError) or v != writer.acked[k]]
        assert lost == [], f"{len(lost)} of {len(keys)} acknowledged objects lost or changed, e.g. {lost[:5]}"
