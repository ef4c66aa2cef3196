"""The master's native front (native/src/meta/serve.cpp, MasterService.serve_native): a get or exists request is
answered in C++ with what the Python path answers (decoded reply, counters, the lease and LRU it touches), and
every request it does not take is left to the Python path with nothing changed. In-process, the real native table;
the RPC server's use of it is covered by every store test over RPC and by test_master_fuzz.py."""

import msgspec
import pytest

from kvplugins.store.config import MasterConfig
from kvplugins.store.master.metadata import FRONT_EXISTS, FRONT_GET
from kvplugins.store.master.service import FRONT_MAX_KEYS, MasterService
from kvplugins.store.wire.protocol import OK

BOTH = FRONT_GET | FRONT_EXISTS


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _service(**cfg) -> MasterService:
    clock = Clock()
    svc = MasterService(MasterConfig(lease_ttl_ms=1000, eviction_grace_ms=0, alloc_align=64, **cfg), clock=clock)
    svc.clock_ = clock
    for seg in ("s0", "s1"):
        wire = {"v": 1, "segment_id": seg, "host_id": "h", "transports": {}, "regions": [[1, 1 << 20, None]]}
        [(code, _)] = svc.handle("register_segment", [[wire, 1, 1 << 20]], {})
        assert code == OK
    return svc


def _put(svc, key: str, size: int = 64, checksum=None, replicas: int = 1) -> None:
    [(code, _)] = svc.handle("put_start", [[key, size]], {"replicas": replicas})
    assert code == OK
    opts = {"xxh3": [checksum]} if checksum is not None else {}
    assert svc.handle("put_commit", [key], opts) == [[OK, None]]


def _body(op: str, keys, opts=None, rid: int = 7) -> bytes:
    return msgspec.msgpack.encode([1, rid, op, keys, {} if opts is None else opts])


def _python(svc, op: str, keys, opts=None) -> list:
    return [1, 7, True, msgspec.msgpack.decode(msgspec.msgpack.encode(svc.handle(op, keys, opts or {})))]


def _leases(svc, keys) -> list:
    return [(o.lease_until, o.last_access) if (o := svc.table.get(k)) is not None else None for k in keys]


@pytest.fixture
def svc():
    s = _service()
    _put(s, "a", 64, checksum=2**64 - 1)
    _put(s, "b", 128)
    _put(s, "c", 4096, checksum=5)
    [(code, _)] = s.handle("put_start", [["pending", 64]], {})  # started, never committed: a miss
    assert code == OK
    return s


@pytest.mark.parametrize(
    "op,opts",
    [("get", {"cols": 1}), ("get", {"cols": True}), ("get", {}), ("get", {"cols": 0}), ("exists", {})],
)
def test_the_native_answer_is_the_python_one_with_the_same_counts_and_leases(svc, op, opts):
    keys = ["a", "missing", "b", "pending", "c", "a"]
    before = dict(svc.counters)
    svc.clock_.t += 1
    served = svc.serve_native(_body(op, keys, opts), BOTH)
    assert served is not None and served[1] == op
    native, native_counts, native_leases = msgspec.msgpack.decode(served[0]), dict(svc.counters), _leases(svc, keys)
    assert native[:3] == [1, 7, True]
    python = _python(svc, op, keys, opts)
    assert native == python
    assert native_leases == _leases(svc, keys)  # the same clock: the Python get set what the native one had
    delta = {k: native_counts[k] - before[k] for k in before if native_counts[k] != before[k]}
    again = {k: svc.counters[k] - native_counts[k] for k in before if svc.counters[k] != native_counts[k]}
    assert delta == again and delta  # counted as the Python path counts (hits/misses or lookup_keys/hits)
    if op == "get":
        assert _leases(svc, ["a"])[0][0] == svc.clock_.t + 1.0  # the lease was raised to now + lease_ttl_ms


@pytest.mark.parametrize(
    "body",
    [
        _body("put", [["a", 64]]),  # another op
        _body("get", ["a"], {"cols": 2}),  # an option value the schema refuses
        _body("get", ["a"], {"colz": 1}),  # an unknown option
        _body("exists", ["a"], {"cols": 1}),  # exists takes no option
        _body("get", []),  # no key
        _body("get", ["é"]),  # not ASCII: msgspec checks it
        _body("get", [""]),  # empty key
        _body("get", ["a" * (MasterConfig().max_key_bytes + 1)]),  # over max_key_bytes
        _body("get", [1]),  # not a str
        _body("get", ["a"], rid=2**63),  # rid out of range
        msgspec.msgpack.encode([2, 7, "get", ["a"], {}]),  # another version
        msgspec.msgpack.encode([1, 7, "get", ["a"]]),  # not a 5-array
        _body("get", ["a"]) + b"\x00",  # bytes past the request
        _body("get", ["a"])[:-1],  # truncated
        _body("get", [f"k{i}" for i in range(FRONT_MAX_KEYS + 1)]),  # a batch the Python path slices
    ],
)
def test_what_the_front_does_not_take_it_leaves_untouched(svc, body):
    counts, leases = dict(svc.counters), _leases(svc, ["a"])
    assert svc.serve_native(body, BOTH) is None
    assert svc.counters == counts and _leases(svc, ["a"]) == leases


def test_an_op_outside_the_callers_role_bits_goes_to_python(svc):
    assert svc.serve_native(_body("get", ["a"]), FRONT_EXISTS) is None
    assert svc.serve_native(_body("exists", ["a"]), FRONT_GET) is None
    assert svc.serve_native(_body("exists", ["a"]), FRONT_EXISTS) is not None


def test_objects_it_cannot_describe_and_suspect_segments_go_to_python(svc):
    _put(svc, "two", 64, replicas=2)  # a second replica: the Python answer lists every location
    leases = _leases(svc, ["a", "two"])
    assert svc.serve_native(_body("get", ["a", "two"], {"cols": 1}), BOTH) is None
    assert _leases(svc, ["a", "two"]) == leases  # nothing touched before it gave up
    assert svc.serve_native(_body("exists", ["two"]), BOTH) is not None  # exists needs no location
    svc.segments.suspect.add("s0:1")
    assert svc.serve_native(_body("get", ["a"]), BOTH) is None
    assert svc.serve_native(_body("exists", ["a"]), BOTH) is None


@pytest.mark.parametrize("op,opts", [("get", {"cols": 1}), ("get", {}), ("exists", {})])
def test_a_big_batch_of_hits_and_misses_answers_as_the_python_path(op, opts):
    """Past the lookups' prefetch distance (Table::find_many), keys present and absent interleaved."""
    svc = _service()
    for i in range(0, 600, 2):
        _put(svc, f"big/{i}", 64 + i, checksum=i)
    keys = [f"big/{i}" for i in range(600)] + ["big/0"]
    served = svc.serve_native(_body(op, keys, opts), BOTH)
    assert served is not None
    assert msgspec.msgpack.decode(served[0]) == _python(svc, op, keys, opts)
