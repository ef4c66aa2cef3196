"""A node's disk-tier promote endpoint (kvplugins/store/node/disk/server.py) survives what a client can send (issue
#11): requests are typed at the boundary (a bad one is refused naming the field, nothing applied, the connection
kept); a flood past its descriptor limit (EMFILE) leaves an established client served and it recovers; connection
caps refuse with the reason; idle and slowloris connections are closed within their timeouts. The endpoint runs
in its own process (tests/helpers/limited_server.py) with a stand-in promote op that answers ``[0, key + "!"]``
per key and counts the keys it was given."""

import socket
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers.auth import authenticated
from helpers.limited_server import LimitedServer, closed_within, flood
from kvplugins.config import load
from kvplugins.errors import ConfigError, MasterUnreachable, StoreError
from kvplugins.store.wire import protocol
from kvplugins.store.config import StoreNodeConfig
from kvplugins.store.node.disk.server import MAX_KEY
from kvplugins.store.client.rpc import RawRpcClient

MAX_BATCH = 8


def _port(srv) -> int:
    return int(srv.info["address"].rsplit(":", 1)[1])


def _promote_ok(rpc: RawRpcClient, keys: list[str]) -> None:
    assert rpc.call("promote", keys) == [[0, k + "!"] for k in keys]


def _raw(port: int, body: bytes, timeout_s: float = 5) -> list | None:
    """Send one frame with ``body``; the decoded reply, or None if the endpoint closed the connection."""
    with authenticated(socket.create_connection(("127.0.0.1", port), timeout=timeout_s), "data") as s:
        s.sendall(protocol.HEADER.pack(len(body)) + body)
        buf = b""
        while len(buf) < 4 or len(buf) < 4 + protocol.HEADER.unpack(buf[:4])[0]:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return msgpack.unpackb(buf[4:], raw=False)


@pytest.fixture(scope="module")
def endpoint():
    with LimitedServer("promote", config={"max_batch": MAX_BATCH}) as srv:
        yield srv


def test_limits_config_keys_validate_and_come_from_env():
    cfg = load(
        StoreNodeConfig,
        environ={
            "KVPLUGINS_STORE_PROMOTE_MAX_CONNECTIONS": "9",
            "KVPLUGINS_STORE_PROMOTE_MAX_CONNECTIONS_PER_PEER": "4",
            "KVPLUGINS_STORE_PROMOTE_IDLE_TIMEOUT_MS": "2500",
            "KVPLUGINS_STORE_METRICS_TIMEOUT_MS": "750",
        },
    )
    lim = cfg.promote_limits()
    assert (lim.max_connections, lim.max_per_peer, lim.idle_timeout_s, lim.frame_timeout_s) == (9, 4, 2.5, 10.0)
    assert cfg.metrics_limits().frame_timeout_s == 0.75 and cfg.promote_max_batch == 65536
    for bad in (
        {"promote_max_connections": -1},
        {"promote_frame_timeout_ms": 0},
        {"promote_max_batch": 0},
        {"metrics_max_connections_per_peer": -2},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            StoreNodeConfig(**bad)


@pytest.mark.parametrize(
    "entries, opts, field",
    [
        ([1, "b"], {}, "invalid entries: Expected `str`, got `int` - at `$[0]`"),
        (["a", ["nested", ["deeper"]]], {}, "invalid entries: Expected `str`, got `array` - at `$[1]`"),
        ([f"k{i}" for i in range(MAX_BATCH + 1)], {}, f"store.promote_max_batch={MAX_BATCH}"),
        (["a", ""], {}, "at `$[1]`"),
        (["x" * (MAX_KEY + 1)], {}, f"keys are at most {MAX_KEY} characters"),
        ([], {}, "invalid entries"),
        (["a"], {"pin": 1}, "invalid opts: Object contains unknown field `pin`"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field_and_applies_nothing(endpoint, entries, opts, field):
    rpc = RawRpcClient(endpoint.info["address"], 3000, "data")
    try:
        before = endpoint.stats()["applied"]
        with pytest.raises(StoreError, match="refused promote") as err:
            rpc.call("promote", entries, opts)
        assert field in str(err.value)
        assert endpoint.stats()["applied"] == before  # never a partial apply
        _promote_ok(rpc, ["still", "served"])  # the same connection serves on
    finally:
        rpc.close()


def test_a_malformed_envelope_closes_only_that_connection(endpoint):
    port = _port(endpoint)
    for body in (
        msgpack.packb([1, 2, "promote", ["a"]]),
        msgpack.packb([2, 1, "promote", ["a"], {}]),
        msgpack.packb({"v": 1}),
        b"\xc1garbage",
        msgpack.packb([1, -1, "promote", ["a"], {}]),
    ):
        assert _raw(port, body) is None, body
    reply = _raw(port, msgpack.packb([1, 7, "nope", [], {}]))
    assert reply[:3] == [1, 7, False] and "unknown op 'nope'" in reply[3]
    assert _raw(port, msgpack.packb([1, 8, "promote", ["a"], {}])) == [1, 8, True, [[0, "a!"]]]
    assert endpoint.alive()


_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=20),
        st.binary(max_size=20),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=20,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    entries=st.one_of(_values, st.lists(st.one_of(st.text(min_size=1, max_size=8), _values), max_size=12)),
    opts=st.one_of(_values, st.just({})),
)
def test_fuzzed_promote_payloads_are_answered_or_refused_whole(endpoint, entries, opts):
    port = _port(endpoint)
    before = endpoint.stats()["applied"]
    reply = _raw(port, msgpack.packb([1, 5, "promote", entries, opts], use_bin_type=True))
    valid = (
        isinstance(entries, list)
        and 0 < len(entries) <= MAX_BATCH
        and opts == {}
        and all(isinstance(k, str) and 0 < len(k) for k in entries)
    )
    assert reply is not None and reply[:2] == [1, 5]
    if valid:
        assert reply == [1, 5, True, [[0, k + "!"] for k in entries]]
        assert endpoint.stats()["applied"] == before + len(entries)
    else:
        assert reply[2] is False and reply[3].startswith("promote: invalid "), reply
        assert endpoint.stats()["applied"] == before
    assert endpoint.alive()


@pytest.mark.timeout(120)
def test_descriptor_exhaustion_keeps_established_client_and_recovers():
    with LimitedServer("promote", nofile=64, config={"idle_timeout_s": 60}) as srv:
        rpc = RawRpcClient(srv.info["address"], 3000, "data")
        try:
            _promote_ok(rpc, ["before"])
            socks = flood(_port(srv), 150)
            try:
                st_ = srv.wait_stats(lambda s: s["accept_failures"] > 0)
                assert st_["accept_failures"] > 0, f"the flood of {len(socks)} did not exhaust 64 fds: {st_}"
                for i in range(5):
                    _promote_ok(rpc, [f"during-{i}", "x"])  # the established client is served
            finally:
                for s in socks:
                    s.close()
        finally:
            rpc.close()
        accepts = srv.log_lines("accept failed")
        assert any("accept failed (Too many open files)" in ln for ln in accepts), accepts
        ok, deadline = None, time.monotonic() + 30
        while ok is None and time.monotonic() < deadline:  # recovered: a new client is served
            fresh = RawRpcClient(srv.info["address"], 3000, "data")
            try:
                ok = fresh.call("promote", ["after"])
            except MasterUnreachable:
                pass
            finally:
                fresh.close()
        assert ok == [[0, "after!"]]
        assert srv.alive()


@pytest.mark.timeout(120)
def test_global_and_per_peer_caps_refuse_with_the_reason():
    with LimitedServer("promote", config={"max_connections": 3, "max_per_peer": 2}) as srv:
        port = _port(srv)

        def hold(source):
            return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))

        held = [hold("127.0.0.1"), hold("127.0.0.2"), hold("127.0.0.2")]
        assert srv.wait_stats(lambda s: s["connections"] == 3)["connections"] == 3
        rpc = RawRpcClient(srv.info["address"], 3000, "data")
        with pytest.raises(MasterUnreachable, match=r"connection refused: .*store\.promote_max_connections=3"):
            rpc.call("promote", ["k"])
        for s in held[1:]:
            s.close()
        srv.wait_stats(lambda s: s["connections"] == 1)  # released before the next one comes
        held = [held[0], hold("127.0.0.1")]
        assert srv.wait_stats(lambda s: s["connections"] == 2)["connections"] == 2
        with pytest.raises(
            MasterUnreachable,
            match=r"127\.0\.0\.1 has 2 connections open .*"
            r"store\.promote_max_connections_per_peer=2",
        ):
            rpc.call("promote", ["k"])
        st_ = srv.stats()
        assert st_["refused"] == 2 and st_["applied"] == 0
        assert "refused connection to the promote endpoint" in srv.log()
        for s in held:
            s.close()
        srv.wait_stats(lambda s: s["connections"] == 0)
        try:
            _promote_ok(rpc, ["now", "served"])
        finally:
            rpc.close()


@pytest.mark.timeout(120)
def test_idle_and_slow_connections_are_closed_within_their_timeouts():
    with LimitedServer("promote", config={"idle_timeout_s": 0.5, "frame_timeout_s": 0.5}) as srv:
        port = _port(srv)
        body = msgpack.packb([1, 1, "promote", ["k"], {}])
        frame = protocol.HEADER.pack(len(body)) + body
        t_idle = closed_within(authenticated(socket.create_connection(("127.0.0.1", port), timeout=5), "data"), 5)
        half = authenticated(socket.create_connection(("127.0.0.1", port), timeout=5), "data")
        half.sendall(frame[:2])  # half the length header, then nothing
        t_half = closed_within(half, 5)
        trickle = authenticated(socket.create_connection(("127.0.0.1", port), timeout=5), "data")
        t_trickle = closed_within(trickle, 5, frame, every_s=0.1)
        for t in (t_idle, t_half, t_trickle):
            assert t is not None and 0.3 < t < 2.5, (t_idle, t_half, t_trickle)
        st_ = srv.stats()
        assert st_["closed_idle"] >= 1 and st_["closed_slow"] >= 2 and st_["applied"] == 0, st_
        assert "store.promote_frame_timeout_ms" in srv.log()
        assert _raw(port, body) == [1, 1, True, [[0, "k!"]]]
