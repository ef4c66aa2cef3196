"""Schema-aware fuzz (hypothesis) of every master op against a live ``kvplugins master`` on loopback (issue #11).

Every example runs on a connection authenticated as admin (so each op reaches its schema); the same templates
sent unauthenticated are refused unserved (test_unauthenticated_requests_get_nothing). Each op has a valid
template request; each example changes one field of it (a leaf or a container, in entries or
opts) to a wrong type, a negative, zero or huge number, an over-long string or bytes, deep nesting, or removes
it, adds an extra one, or duplicates the batch's first entry. After every example: the master answered (a
result or a refusal naming the field, never a dropped connection), the same connection still serves, the
sentinel objects stored before the run read back byte for byte after every refused request (a request that
is still valid, such as remove_all with force=True, may remove them: they are put back), and (every few examples) a normal client's put
and get of fresh bytes are right. Bounded: EXAMPLES per op (KVPLUGINS_FUZZ_EXAMPLES overrides), no deadline.
"""

from __future__ import annotations

import copy
import itertools
import os
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers.auth import authenticated, read_until_closed
from helpers.cluster import store_cluster

from kvplugins.errors import ProtocolError
from kvplugins.security import handshake
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.wire import protocol
from kvplugins.store.config import MasterConfig
from kvplugins.store.master.service import MasterService
from kvplugins.store.client.rpc import RawRpcClient

RIDS = itertools.count(1)
EXAMPLES = int(os.environ.get("KVPLUGINS_FUZZ_EXAMPLES", "60"))
NOSEG = "fz-no-such-segment"
WIRE = {
    "v": 1,
    "segment_id": "fz-bogus",
    "host_id": "fz",
    "transports": {"tcp": {"host": "127.0.0.1", "port": 1}},
    "regions": [[1, 4096, None]],
}
TEMPLATES = {
    "info": ([], {}),
    "status": ([], {}),
    "put_start": ([["fz/a", 64]], {"replicas": 1, "segment": "", "pin": 0, "pin_ttl_ms": 0}),
    "put_commit": (["fz/a"], {"xxh3": [7]}),
    "put_abort": (["fz/b"], {}),
    "reserve": ([4096], {"release": [1]}),
    "put": ([["fz/c", 64, 1, 0]], {"xxh3": [7]}),
    "get": (["fz/a"], {"cols": 1}),
    "exists": (["fz/a"], {}),
    "exists_prefix": (["fz/a"], {}),
    "remove": (["fz/zz"], {}),
    "get_size": (["fz/a"], {}),
    "remove_checked": (["fz/zz"], {"force": False}),
    "remove_by_regex": (["^fz/none$"], {"force": False}),
    "remove_all": ([], {"force": False}),
    "report_corrupt": ([["fz/a", NOSEG, 0, 1]], {}),
    "register_segment": ([[WIRE, 1, 4096]], {}),
    "heartbeat": ([NOSEG], {}),
    "unregister": ([NOSEG], {}),
    "describe": ([NOSEG], {}),
    "drain": ([NOSEG], {}),
    "tier_poll": ([NOSEG], {}),
    "tier_register": ([[NOSEG, "127.0.0.1:1", 1024, [["fz/f", 64, 7]], "disk"]], {"more": 0}),
    "tier_done": ([["offload", "fz/a", True, 5, 0]], {"segment": NOSEG}),
    "promote_start": (["fz/a"], {"segment": NOSEG}),
    "promote_commit": ([["fz/a", True, None]], {"segment": NOSEG}),
    "task_create": ([["copy", "fz/a", "", [NOSEG]]], {}),
    "task_query": ([[1, 2]], {}),
}


def nested(depth: int):
    v: list = []
    for _ in range(depth):
        v = [v]
    return v


BAD = [
    None,
    True,
    -1,
    0,
    -(1 << 63),
    (1 << 64) - 1,
    1.5,
    "",
    "x" * 100_000,
    b"\xff" * 100_000,
    nested(200),
    {},
    [],
    {"k": 1},
    [1, "a", None],
]


def paths(obj, at=()):
    """Every position in a request (entries list, opts dict) as a tuple of indices/keys."""
    yield at
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, at + (i,))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, at + (k,))


def mutate(req: list, path: tuple, kind: str, bad):
    """A copy of ``req`` ([entries, opts]) with the field at ``path`` replaced, removed, or an extra added."""
    req = copy.deepcopy(req)
    if not path:
        return req
    parent = req
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if kind == "replace":
        parent[last] = bad
    elif kind == "missing":
        del parent[last]
    elif kind == "extra":
        if isinstance(parent, list):
            parent.insert(last + 1, bad)
        else:
            parent["extra_field"] = bad
    elif kind == "duplicate" and isinstance(req[0], list) and req[0]:
        req[0] = req[0] + [copy.deepcopy(req[0][0])] * 3
    return req


def connect(address: str, authenticate: bool = True) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return authenticated(sock) if authenticate else sock


def send(sock: socket.socket, msg: list) -> None:
    body = protocol.pack(msg)
    sock.sendall(protocol.HEADER.pack(len(body)) + body)


def raw_call(sock: socket.socket, op: str, entries, opts) -> tuple[bool, object]:
    """One request on a raw connection, sent exactly as given (no client-side checks); (ok, payload)."""
    rid = next(RIDS)
    send(sock, [protocol.VERSION, rid, op, entries, opts])
    head = recv_exactly(sock, protocol.HEADER.size)
    return protocol.parse_response(protocol.unpack(recv_exactly(sock, protocol.HEADER.unpack(head)[0])), rid)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "the master closed the connection"
        buf += chunk
    return bytes(buf)


@pytest.fixture(scope="module")
def live():
    with store_cluster(nodes=1, segment_size="16MiB") as c, StoreClient(ClientConfig(master=c.master)) as client:
        sentinels = {f"sentinel/{i}": bytes([i + 1]) * (1000 + i) for i in range(8)}
        assert client.batch_put(list(sentinels), list(sentinels.values())) == [None] * 8
        rpc = RawRpcClient(c.master, 5000, "admin")
        segments = {s["name"] for s in rpc.call("status")["segments"]}
        yield c, client, rpc, sentinels, segments
        rpc.close()
        assert c.master_proc.alive(), c.master_proc.log_tail()


def test_every_op_has_a_template():
    assert set(TEMPLATES) == set(MasterService(MasterConfig())._ops)


@pytest.mark.parametrize("op", sorted(TEMPLATES))
def test_fuzz_op(live, op):
    cluster, client, rpc, sentinels, segments = live
    template = [list(TEMPLATES[op][0]), dict(TEMPLATES[op][1])]
    where = list(paths(template))[1:]
    count = [0]
    conn = [connect(cluster.master)]

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(
        path=st.sampled_from(where),
        kind=st.sampled_from(["replace", "missing", "extra", "duplicate"]),
        bad=st.sampled_from(BAD),
    )
    def one(path, kind, bad):
        req = mutate(template, path, kind, bad)
        assert client.batch_get(list(sentinels)) == list(sentinels.values())  # leased, and unchanged
        ok = False
        if len(req) != 2:  # the envelope itself broken: that connection is closed
            send(conn[0], [protocol.VERSION, next(RIDS), op, *req])
            assert conn[0].recv(1) == b""
            conn[0].close()
            conn[0] = connect(cluster.master)
        else:
            ok, payload = raw_call(conn[0], op, *req)
            assert ok or f"{op}: " in payload, payload  # a refusal names the op (and the field)
        if ok:  # a still valid request ran (e.g. remove_all with force=True): restore the sentinels
            client.batch_put(list(sentinels), list(sentinels.values()))
        else:  # a refused one changed nothing
            assert client.batch_get(list(sentinels)) == list(sentinels.values())
        assert raw_call(conn[0], "exists", ["sentinel/0"], {}) == (True, [True])  # the connection serves on
        for seg in {s["name"] for s in rpc.call("status")["segments"]} - segments:
            rpc.call("unregister", [seg])  # a valid bogus segment: take it out
        count[0] += 1
        if count[0] % 5 == 0:
            data = os.urandom(3000)
            client.put(f"fresh/{op}/{count[0]}", data)
            assert client.get(f"fresh/{op}/{count[0]}") == data

    try:
        one()
    finally:
        conn[0].close()
    assert client.batch_get(list(sentinels)) == list(sentinels.values())
    assert cluster.master_proc.alive(), cluster.master_proc.log_tail()


@pytest.mark.parametrize("op", sorted(TEMPLATES))
def test_unauthenticated_requests_get_nothing(live, op):
    """Each op's template, and the template with its first field broken, sent without a handshake: refused
    (REFUSED, then closed), nothing served, the sentinels unchanged."""
    cluster, client, rpc, sentinels, segments = live
    template = [list(TEMPLATES[op][0]), dict(TEMPLATES[op][1])]
    for req in (template, mutate(template, next(iter(list(paths(template))[1:]), ()), "replace", None)):
        with connect(cluster.master, authenticate=False) as s:
            send(s, [protocol.VERSION, next(RIDS), op, *req])
            answer = read_until_closed(s)
        assert answer[:4] == handshake.MAGIC and answer[5] == handshake.REFUSED and len(answer) == handshake.MSG.size
    assert client.batch_get(list(sentinels)) == list(sentinels.values())
    assert {s["name"] for s in rpc.call("status")["segments"]} == segments


def test_deeply_nested_values_are_refused_with_a_bounded_message():
    """The atheris fuzz found a request whose version field nested lists ~500 deep: naming it in the error took
    repr() past the recursion limit (RecursionError instead of ProtocolError). Messages now use a bounded repr."""
    nested = 0
    for _ in range(5000):
        nested = [nested]
    with pytest.raises(ProtocolError, match=r"request version \[\[.*unsupported") as err:
        protocol.parse_request([nested, 1, "put_commit", [], {}])
    assert len(str(err.value)) < 200
    with pytest.raises(ProtocolError, match="malformed response from master"):
        protocol.parse_response([nested], 1)
    with pytest.raises(ProtocolError):
        protocol.parse_response([protocol.VERSION, 0, False, nested], 1)
