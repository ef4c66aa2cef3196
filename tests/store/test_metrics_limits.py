"""The Prometheus endpoint (kvplugins/store/metrics.py Endpoint) degrades instead of dying (issue #11): a flood past
its descriptor limit (EMFILE) leaves an accepted scrape served and it recovers; connection caps answer 503 naming
the limit; scrapers that send nothing, half a request or a byte at a time are dropped within the timeout; close()
ends connections a peer holds open. The endpoint runs in its own process (tests/helpers/limited_server.py) with a
gauge ``kvplugins_test_value`` = 42."""

import socket
import time
import urllib.error
import urllib.request

import pytest

from helpers.limited_server import LimitedServer, closed_within, flood
from kvplugins.security.limits import ConnLimits
from kvplugins.store.metrics import Endpoint

SERIES = b"kvplugins_test_value 42.0"


def _scrape(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _get(sock: socket.socket) -> bytes:
    """Send a scrape on an open connection; everything the endpoint answers until it closes."""
    sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


@pytest.mark.timeout(120)
def test_descriptor_exhaustion_keeps_accepted_scrape_and_recovers():
    with LimitedServer("metrics", nofile=64, config={"frame_timeout_s": 30}) as srv:
        assert _scrape(srv.info["url"])[0] == 200
        early = socket.create_connection(("127.0.0.1", srv.info["port"]), timeout=10)
        assert srv.wait_stats(lambda s: s["connections"] == 1)["connections"] == 1
        socks = flood(srv.info["port"], 150)
        try:
            st = srv.wait_stats(lambda s: s["accept_failures"] > 0)
            assert st["accept_failures"] > 0, f"the flood of {len(socks)} did not exhaust 64 fds: {st}"
            reply = _get(early)  # accepted before the flood: served during it
            assert reply.startswith(b"HTTP/1.0 200") and SERIES in reply, reply[:300]
        finally:
            for s in socks:
                s.close()
            early.close()
        accepts = srv.log_lines("accept failed")
        assert any("accept failed (Too many open files)" in ln for ln in accepts), accepts
        status, deadline = None, time.monotonic() + 30
        while status != 200 and time.monotonic() < deadline:  # recovered: new scrapes are served
            try:
                status, body = _scrape(srv.info["url"])
            except OSError:
                time.sleep(0.1)
        assert status == 200 and SERIES in body
        assert srv.alive()


@pytest.mark.timeout(120)
def test_global_and_per_peer_caps_answer_503_naming_the_limit():
    with LimitedServer("metrics", config={"max_connections": 3, "max_per_peer": 2, "frame_timeout_s": 30}) as srv:
        port, url = srv.info["port"], srv.info["url"]

        def hold(source):
            return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))

        held = [hold("127.0.0.1"), hold("127.0.0.2"), hold("127.0.0.2")]
        assert srv.wait_stats(lambda s: s["connections"] == 3)["connections"] == 3
        status, body = _scrape(url)
        assert status == 503 and b"store.metrics_max_connections=3" in body, (status, body)
        for s in held[1:]:
            s.close()
        srv.wait_stats(lambda s: s["connections"] == 1)  # released before the next one comes
        held = [held[0], hold("127.0.0.1")]
        assert srv.wait_stats(lambda s: s["connections"] == 2)["connections"] == 2
        status, body = _scrape(url)
        assert status == 503 and b"store.metrics_max_connections_per_peer=2" in body, (status, body)
        assert srv.stats()["refused"] == 2
        assert "refused connection to the metrics endpoint" in srv.log()
        for s in held:
            s.close()
        srv.wait_stats(lambda s: s["connections"] == 0)
        status, body = _scrape(url)
        assert status == 200 and SERIES in body


@pytest.mark.timeout(120)
def test_silent_half_and_trickling_scrapers_are_dropped_within_the_timeout():
    with LimitedServer("metrics", config={"frame_timeout_s": 0.5}) as srv:
        port = srv.info["port"]
        t_idle = closed_within(socket.create_connection(("127.0.0.1", port), timeout=5), 5)
        half = socket.create_connection(("127.0.0.1", port), timeout=5)
        half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never end
        t_half = closed_within(half, 5)
        trickle = socket.create_connection(("127.0.0.1", port), timeout=5)
        request = b"GET /metrics HTTP/1.0\r\n" + b"X-Pad: " + b"a" * 200 + b"\r\n\r\n"
        t_trickle = closed_within(trickle, 5, request, every_s=0.05)  # every recv progresses; the whole never comes
        for t in (t_idle, t_half, t_trickle):
            assert t is not None and 0.3 < t < 2.5, (t_idle, t_half, t_trickle)
        st = srv.wait_stats(lambda s: s["closed_slow"] >= 3 and s["connections"] == 0)
        assert st["closed_slow"] >= 3 and st["connections"] == 0, st
        status, body = _scrape(srv.info["url"])
        assert status == 200 and SERIES in body


def test_close_ends_connections_a_peer_holds_open():
    endpoint = Endpoint("127.0.0.1", 0, "a test", ConnLimits(8, 8, 0.0, 60.0))
    port = int(endpoint.url.split(":")[2].split("/")[0])
    held = socket.create_connection(("127.0.0.1", port), timeout=5)
    deadline = time.monotonic() + 5
    while endpoint.stats()["connections"] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    endpoint.close()
    assert time.monotonic() - t0 < 3
    assert closed_within(held, 2) is not None
    held.close()
