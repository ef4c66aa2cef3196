"""The master's native front for a slab put (native/src/meta/serve.cpp commit_put, slabs.py Slabs.serve_put): the
request is applied as the Python path (slabs.py op_put) applies it — same reply, objects, LRU order, counters,
allocator cuts and slab front — and every put it does not take is left to the Python path with nothing changed.
In-process, the real native table; over RPC every store test's slab puts go through it."""

import msgspec
import pytest

from kvplugins.store.config import MasterConfig
from kvplugins.store.master.metadata import FRONT_EXISTS, FRONT_GET, FRONT_PUT
from kvplugins.store.master.service import MasterService
from kvplugins.store.wire.protocol import EXISTS, OK

ALL = FRONT_GET | FRONT_EXISTS | FRONT_PUT
ALIGN = 64
SEG = 1 << 27  # slabs need a segment of 64 MiB or more (slabs.py)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _service(**config) -> MasterService:
    clock = Clock()
    cfg = MasterConfig(lease_ttl_ms=1000, eviction_grace_ms=0, alloc_align=ALIGN, put_timeout_ms=5000, **config)
    svc = MasterService(cfg, clock=clock)
    svc.clock_ = clock
    wire = {"v": 1, "segment_id": "s0", "host_id": "h", "transports": {}, "regions": [[1, SEG, None]]}
    [(code, _)] = svc.handle("register_segment", [[wire, 1, SEG]], {})
    assert code == OK
    return svc


def _reserve(svc) -> tuple[int, int]:
    """A new slab: (slab id, its first offset)."""
    [(code, value)] = svc.handle("reserve", [1 << 20], {})
    assert code == OK
    return value[0], value[3]


def _entries(sid: int, front: int, sizes, prefix: str = "k") -> list:
    out, at = [], front
    for j, n in enumerate(sizes):
        out.append([f"{prefix}{j}", n, sid, at])
        at += -(-n // ALIGN) * ALIGN
    return out


def _body(entries, opts=None, rid: int = 9) -> bytes:
    return msgspec.msgpack.encode([1, rid, "put", entries, {} if opts is None else opts])


def _state(svc, keys) -> dict:
    """What a put changes: each object's fields, the LRU order, counters, the slabs' fronts and the allocator."""
    objs = {}
    for k in keys:
        o = svc.table.get(k)
        objs[k] = None if o is None else (o.size, o.replicas, o.complete, o.born, o.last_access, o.checksum, o.pin)
    seg = svc.segments.get("s0:1")
    slabs = {s.id: (s.front, s.end, s.expires) for s in svc.slabs._slabs.values()}
    alloc = (seg.allocator.used_bytes, seg.allocator.free_blocks(), seg.allocator.largest_free())
    lru = [o.key for o in svc.table.lru()]
    table = (len(svc.table), svc.table.count_on("s0:1"))
    return {"objs": objs, "lru": lru, "counters": dict(svc.counters), "slabs": slabs, "alloc": alloc, "table": table}


SIZES = [4096, 100, 1, 64, 65, 8192, 3000]


@pytest.mark.parametrize(
    "opts",
    [{}, {"xxh3": None}, {"xxh3": [2**64 - 1, None, 0, 5, None, 7, 8]}],
    ids=["no-sums", "sums-nil", "sums"],
)
def test_the_native_put_is_the_python_put(opts):
    native, python = _service(), _service()
    (sid, front), again = _reserve(native), _reserve(python)
    assert again == (sid, front)
    entries = _entries(sid, front, SIZES)
    keys = [e[0] for e in entries]
    for svc in (native, python):
        svc.clock_.t += 0.5
    served = native.serve_native(_body(entries, opts), ALL)
    assert served is not None and served[1] == "put"
    reply = msgspec.msgpack.decode(served[0])
    assert reply == [1, 9, True, msgspec.msgpack.decode(msgspec.msgpack.encode(python.handle("put", entries, opts)))]
    assert reply[3] == [[OK, None]] * len(SIZES)
    assert _state(native, keys) == _state(python, keys)
    cut = [native.segments.get("s0:1").allocator.size_at(e[3]) for e in entries]
    assert cut == [-(-n // ALIGN) * ALIGN for n in SIZES]  # each object its own allocation, freed on its own
    more = _entries(sid, entries[-1][3] + cut[-1], [10, 20], prefix="m")  # the next batch goes on from the front
    assert native.serve_native(_body(more), ALL) is not None
    python.handle("put", more, {})
    assert _state(native, keys + ["m0", "m1"]) == _state(python, keys + ["m0", "m1"])
    get = native.serve_native(msgspec.msgpack.encode([1, 3, "get", keys, {}]), ALL)
    assert [a[1][1][0][2] for a in msgspec.msgpack.decode(get[0])[3]] == [e[3] for e in entries]


def _refused_bodies(svc, sid: int, front: int) -> dict:
    ok = _entries(sid, front, [64, 64])
    return {
        "unknown slab": _body(_entries(sid + 7, front, [64])),
        "a gap before the first": _body(_entries(sid, front + ALIGN, [64])),
        "not back to back": _body([ok[0], [ok[1][0], 64, sid, ok[1][3] + ALIGN]]),
        "past the slab's end": _body(_entries(sid, front, [1 << 20, 64])),
        "two slabs": _body([ok[0], [ok[1][0], 64, sid + 1, ok[1][3]]]),
        "a stored key": _body(_entries(sid, front, [64], prefix="stored")),
        "a repeated key": _body([ok[0], [ok[0][0], 64, sid, ok[1][3]]]),
        "a stored key after new ones": _body([*ok, ["stored0", 64, sid, ok[1][3] + ALIGN]]),
        "a key repeated later": _body([*ok, [ok[0][0], 64, sid, ok[1][3] + ALIGN]]),
        "sums of another length": _body(ok, {"xxh3": [1]}),
        "an unknown option": _body(ok, {"xxh4": None}),
        "a negative sum": _body(ok, {"xxh3": [1, -1]}),
        "not ASCII": _body([["é", 64, sid, front]]),
        "size 0": _body([["z", 0, sid, front]]),
        "a short entry": _body([["z", 64, sid]]),
        "no entries": _body([]),
    }


@pytest.mark.parametrize("case", list(_refused_bodies(None, 1, 0)))
def test_a_put_the_front_does_not_take_changes_nothing(case):
    svc = _service()
    svc.handle("put_start", [["stored0", 64]], {})
    svc.handle("put_commit", ["stored0"], {})
    sid, front = _reserve(svc)
    body = _refused_bodies(svc, sid, front)[case]
    before = _state(svc, ["stored0", "k0", "k1", "z", "é"])
    assert svc.serve_native(body, ALL) is None
    assert _state(svc, ["stored0", "k0", "k1", "z", "é"]) == before


def test_an_expired_slab_a_role_without_put_and_a_shard_go_to_python():
    svc = _service()
    sid, front = _reserve(svc)
    body = _body(_entries(sid, front, [64]))
    assert svc.serve_native(body, FRONT_GET | FRONT_EXISTS) is None
    svc.shard = object()  # a shard's master: shard.py routes its puts (only its keys are put there)
    assert svc.serve_native(body, ALL) is None
    svc.shard = None
    svc.clock_.t += 5.0  # put_timeout_ms: the slab expired
    assert svc.serve_native(body, ALL) is None
    [(code, _)] = svc.handle("put", _entries(sid, front, [64]), {})
    assert code != OK and code != EXISTS  # the Python path refuses it (EXPIRED): the client puts with put_start


def test_a_front_put_on_a_segment_over_the_high_watermark_evicts_down_to_the_low_one():
    """The front's put looks only at its own segment (and any already draining) for watermark evictions: a
    segment the slab's reservation took over the high watermark descends to the low one on the next put."""
    svc = _service(high_watermark=0.5, low_watermark=0.4)
    old = [f"old{i}" for i in range(8)]
    svc.handle("put_start", [[k, 8 << 20] for k in old], {})
    svc.handle("put_commit", old, {})  # 64 MiB of 128: at the high watermark, not over it
    seg = svc.segments.get("s0:1")
    sid, front = _reserve(svc)  # 1 MiB more: over it
    assert svc.counters["evictions"] == 0
    assert svc.serve_native(_body(_entries(sid, front, [4096])), ALL) is not None
    assert svc.counters["evictions"] == 2  # the two least recently used: 65 -> 49 MiB, under 0.4 x 128
    assert svc.table.get("old0") is None and svc.table.get("old1") is None
    assert svc.table.get("k0").complete and seg.used <= 0.4 * SEG
