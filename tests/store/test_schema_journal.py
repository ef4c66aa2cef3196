"""The HA journal's values read back from etcd (#11), one field at a time: an object value's size, replicas,
checksum and pin and a segment value's descriptor, region id and size each get a wrong type, a negative, zero,
a huge value, an over-long string or list, deep nesting, or go missing, or an extra item joins. An oracle says
whether the value still decodes (then to exactly what) or which field the ProtocolError names. ``load`` skips
every value that does not decode with a warning naming its etcd key; recovery of typed but inconsistent values
(unknown segments, offsets outside or overlapping, a segment under another's name) never raises and never
leaves an allocator holding bytes no recovered object owns. No etcd process: a dict stands in for it."""

from __future__ import annotations

import logging

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvplugins.errors import ProtocolError
from kvplugins.store.config import MasterConfig
from kvplugins.store.master.ha import journal
from kvplugins.store.master.ha import recovery
from kvplugins.store.master.ha.journal import EtcdJournal
from kvplugins.store.master.service import MasterService
from kvplugins.store.wire.schema import MAX_NAME, MAX_SIZE

U64 = (1 << 64) - 1
SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Raw(bytes):
    """A value already in msgpack (deep nesting: msgpack's packer refuses past 512 levels)."""

    def __repr__(self) -> str:
        return f"Raw({len(self)} bytes)"


DEEP = Raw(b"\x91" * 3000 + b"\x01")


def pack(value) -> bytes:
    """msgpack of ``value``; lists, tuples and dicts may hold Raw items."""
    if isinstance(value, Raw):
        return bytes(value)
    if isinstance(value, (list, tuple)):
        n = len(value)
        head = (
            bytes([0x90 | n])
            if n < 16
            else b"\xdc" + n.to_bytes(2, "big")
            if n < 1 << 16
            else b"\xdd" + n.to_bytes(4, "big")
        )
        return head + b"".join(pack(v) for v in value)
    if isinstance(value, dict) and len(value) < 16:
        return bytes([0x80 | len(value)]) + b"".join(pack(k) + pack(v) for k, v in value.items())
    return msgpack.packb(value, use_bin_type=True)


hostile = st.one_of(
    st.sampled_from(["1", 1.5, True, False, None, b"\x01", [1], {"a": 1}]),  # wrong type
    st.integers(-(1 << 63), -1),  # negative
    st.just(0),  # zero
    st.sampled_from([MAX_SIZE, MAX_SIZE + 1, 1 << 63, U64]) | st.integers(1 << 32, U64),  # huge
    st.sampled_from(["x" * 5000, b"x" * 5000, [0] * 5000, [["s0:1", 0]] * 65]),  # over-long
    st.just(DEEP),  # deep nesting
)


def is_int(v) -> bool:
    return type(v) is int


def norm(value):
    """``value`` as msgpack gives it back (tuples become lists)."""
    return msgpack.unpackb(msgpack.packb(value))


# ---- object values -------------------------------------------------------------------------------------------
seg_name = st.text(min_size=1, max_size=12)
replica = st.tuples(seg_name, st.integers(0, MAX_SIZE - 1))
valid_object = st.tuples(
    st.integers(1, MAX_SIZE),
    st.lists(replica, min_size=1, max_size=4),
    st.one_of(st.none(), st.integers(0, U64)),
    st.sampled_from([0, 2]),
    st.sampled_from([0, 1]),
    st.integers(0, 64),
).map(list)


def object_oracle(value: list):
    """The decoded tuple if ``value`` is a valid object value, else the regex its ProtocolError must match."""
    if len(value) < 2:
        return "of at least length 2"
    if len(value) > 6:
        return "of at most length 6"
    size, replicas, *rest = value
    if not (is_int(size) and 1 <= size <= MAX_SIZE):
        return r"size: .*at `\$\[0\]`"
    bad = _bad_replicas(replicas)
    if bad:
        return bad
    checksum = rest[0] if rest else None
    if not (checksum is None or (is_int(checksum) and 0 <= checksum <= U64)):
        return r"checksum: .*at `\$\[2\]`"
    pin = rest[1] if len(rest) > 1 else 0
    if not (is_int(pin) and pin in (0, 2)):
        return r"pin: .*at `\$\[3\]`"
    pending = rest[2] if len(rest) > 2 else 0
    if not (is_int(pending) and pending in (0, 1)):
        return r"pending: .*at `\$\[4\]`"
    wanted = rest[3] if len(rest) > 3 else 0
    if not (is_int(wanted) and 0 <= wanted <= 64):
        return r"wanted: .*at `\$\[5\]`"
    return size, [tuple(r) for r in replicas], checksum, pin, pending, wanted


def _bad_replicas(replicas) -> str | None:
    if isinstance(replicas, Raw):
        return r"replicas: .*at `\$\[1\]\[0\]`"
    if not isinstance(replicas, (list, tuple)) or not 1 <= len(replicas) <= 64:
        return r"replicas: .*at `\$\[1\]`"
    for i, r in enumerate(replicas):
        if isinstance(r, Raw) or not isinstance(r, (list, tuple)) or len(r) != 2:
            return rf"replicas: .*at `\$\[1\]\[{i}\]"
        name, off = r
        if not (isinstance(name, str) and 1 <= len(name) <= MAX_NAME):
            return rf"replicas: .*at `\$\[1\]\[{i}\]\[0\]`"
        if not (is_int(off) and 0 <= off < MAX_SIZE):
            return rf"replicas: .*at `\$\[1\]\[{i}\]\[1\]`"
    return None


def check_object(value: list) -> None:
    want = object_oracle(value)
    if isinstance(want, tuple):
        assert journal.decode_object(pack(value)) == want
    else:
        with pytest.raises(ProtocolError, match=want):
            journal.decode_object(pack(value))


@SETTINGS
@given(valid_object, st.integers(0, 5), hostile)
def test_object_field_replaced(value, i, bad):
    value[i] = bad
    check_object(value)


@SETTINGS
@given(valid_object, st.data(), hostile | st.text(min_size=MAX_NAME - 2, max_size=MAX_NAME + 2))
def test_object_replica_item_replaced(value, data, bad):
    replicas = [list(r) for r in value[1]]
    i, j = data.draw(st.integers(0, len(replicas) - 1)), data.draw(st.integers(0, 1))
    replicas[i][j] = bad
    check_object([value[0], replicas, *value[2:]])


@SETTINGS
@given(valid_object, st.integers(0, 5))
def test_object_items_missing(value, keep):
    check_object(value[:keep])  # checksum, pin, pending, wanted may be left out (older values); size, replicas not


@SETTINGS
@given(valid_object, hostile | st.integers(0, 2))
def test_object_extra_item(value, extra):
    check_object(value + [extra])


def test_object_values_of_the_issue_are_refused():
    """#11's crafted values: a nested checksum, a string size, a truncated value, a map instead of an array."""
    for value, match in [
        (msgpack.packb([64, [["s:1", 0]], [[[[1]]]], 0]), r"checksum: .*\$\[2\]"),
        (msgpack.packb(["64", [["s:1", 0]], None, 0]), r"size: .*\$\[0\]"),
        (msgpack.packb([64, [["s:1", 0]], 7, 0])[:-3], "truncated"),
        (msgpack.packb({"size": 64}), "Expected `array`, got `object`"),
        (b"\xc1", "malformed"),
        (b"", "truncated"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            journal.decode_object(value)


# ---- segment values ------------------------------------------------------------------------------------------
def descriptor(segment_id: str = "s0", size: int = 1 << 20) -> dict:
    return {
        "v": 1,
        "segment_id": segment_id,
        "host_id": "h",
        "transports": {"tcp": {"host": "127.0.0.1", "port": 1}},
        "regions": [[1, size, None]],
    }


valid_segment = st.tuples(seg_name.map(descriptor), st.integers(0, (1 << 32) - 1), st.integers(1, MAX_SIZE)).map(list)
DESC_FIELDS = ("v", "segment_id", "host_id", "transports", "regions")


@SETTINGS
@given(valid_segment, st.integers(1, 2), hostile)
def test_segment_region_and_size_replaced(value, i, bad):
    value[i] = bad
    valid = is_int(bad) and (0 <= bad < 1 << 32 if i == 1 else 1 <= bad <= MAX_SIZE)
    if valid:
        assert norm(journal.decode_segment(pack(value))) == norm(value)
    else:
        name = ("region id", "size")[i - 1]
        with pytest.raises(ProtocolError, match=rf"{name}: .*at `\$\[{i}\]`"):
            journal.decode_segment(pack(value))


@SETTINGS
@given(valid_segment, st.sampled_from(DESC_FIELDS), hostile)
def test_segment_descriptor_field_replaced(value, field, bad):
    value[0] = {**value[0], field: bad}
    valid = (
        (
            field in ("host_id", "segment_id")
            and isinstance(bad, str)
            and (field == "host_id" or bad)
            and len(bad) <= MAX_NAME
        )
        or (field == "transports" and bad == {})
        or (field == "regions" and bad == [])
    )
    if valid:
        assert norm(journal.decode_segment(pack(value))[0]) == norm(value[0])
    else:
        with pytest.raises(ProtocolError, match=r"descriptor: .*at `\$\[0\]"):
            journal.decode_segment(pack(value))


@SETTINGS
@given(valid_segment, st.sampled_from(DESC_FIELDS))
def test_segment_descriptor_field_missing(value, field):
    del value[0][field]
    with pytest.raises(ProtocolError, match=rf"descriptor: Object missing required field `{field}` - at `\$\[0\]`"):
        journal.decode_segment(pack(value))


@SETTINGS
@given(valid_segment, st.text(min_size=1, max_size=50).filter(lambda k: k not in DESC_FIELDS), hostile)
def test_segment_descriptor_extra_field(value, field, bad):
    value[0][field] = bad
    with pytest.raises(ProtocolError, match=r"descriptor: Object contains unknown field"):
        journal.decode_segment(pack(value))


@SETTINGS
@given(valid_segment, st.integers(0, 4), hostile)
def test_segment_items_missing_or_extra(value, keep, extra):
    body = value[:keep] if keep < 3 else value + [extra] * (keep - 2)
    with pytest.raises(ProtocolError, match="Expected `array` of length 3"):
        journal.decode_segment(pack(body))


# ---- load: skip with a warning naming the key ----------------------------------------------------------------
class FakeEtcd:
    """The one read ``EtcdJournal.load`` makes: (key, value) under a prefix, in insertion order."""

    def __init__(self, items: dict):
        self.items = items

    def range_prefix(self, prefix: str) -> list:
        return [(k, v) for k, v in self.items.items() if k.startswith(prefix)]


@SETTINGS
@given(
    st.lists(
        st.one_of(
            valid_object.map(lambda v: ("obj", v)),
            valid_segment.map(lambda v: ("seg", v)),
            hostile.map(lambda v: ("obj", v)),
            hostile.map(lambda v: ("seg", v)),
            st.binary(max_size=40).map(lambda b: ("obj", Raw(b))),
        ),
        max_size=12,
    )
)
def test_load_keeps_valid_values_and_names_every_skipped_key(caplog, values):
    items = {f"/p/{kind}/k{i}": pack(v) for i, (kind, v) in enumerate(values)}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvplugins.store.master.ha.journal"):
        segs, objs, _ = EtcdJournal(FakeEtcd(items), "/p").load()
    kept = {f"/p/seg/{s[0]}" for s in segs} | {f"/p/obj/{o[0]}" for o in objs}
    skipped = set(items) - kept
    for key in items:
        decode = journal.decode_segment if "/seg/" in key else journal.decode_object
        try:
            decode(items[key])
            assert key in kept
        except ProtocolError:
            assert key in skipped
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"journal entry {k!r} skipped" in warned for k in skipped)


def test_load_skips_empty_over_long_and_non_utf8_names(caplog):
    value = pack([64, [["s:1", 0]]])
    bad = ["/p/obj/", "/p/obj/" + "k" * (journal.MAX_JOURNAL_KEY + 1), "/p/obj/\udcff\udcfe", "/p/seg/a\nb\udc80"]
    items = {**dict.fromkeys(bad, value), "/p/obj/ok": value}
    with caplog.at_level(logging.WARNING, logger="kvplugins.store.master.ha.journal"):
        segs, objs, _ = EtcdJournal(FakeEtcd(items), "/p").load()
    assert segs == [] and [o[0] for o in objs] == ["ok"]
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) == 4 and all("\n" not in m for m in warned)  # a key cannot forge a log line


# ---- recovery of typed but inconsistent values ---------------------------------------------------------------
SEG = 1 << 16
ALIGN = MasterConfig().alloc_align
names = st.sampled_from(["s0:1", "s1:1", "gone:1"])
offsets = st.one_of(st.integers(0, SEG // ALIGN).map(lambda n: n * ALIGN), st.integers(0, MAX_SIZE - 1))
objects = st.lists(
    st.tuples(
        st.integers(1, SEG),
        st.lists(st.tuples(names, offsets), min_size=1, max_size=4),
        st.one_of(st.none(), st.integers(0, U64)),
        st.sampled_from([0, 2]),
    ),
    max_size=30,
)


@SETTINGS
@given(objects)
def test_recovery_never_raises_and_never_leaks_or_overlaps_bytes(objs):
    service = MasterService(MasterConfig())
    segs = [(f"s{j}:1", descriptor(f"s{j}", SEG), 1, SEG) for j in range(2)]
    entries = [(f"k{i}", size, replicas, checksum, pin) for i, (size, replicas, checksum, pin) in enumerate(objs)]
    got = recovery.restore(service, segs, entries, 0.0)
    assert got["segments"] == 2 and got["objects"] + got["dropped"] == len(entries)
    held: dict[str, list] = {"s0:1": [], "s1:1": []}
    for key, size, _, checksum, pin in entries:
        obj = service.table.get(key)
        if obj is None:
            continue
        assert obj.complete and obj.size == size and obj.checksum == checksum and obj.pin == pin
        for name, off in obj.replicas:
            alloc = service.segments.get(name).allocator
            assert off % ALIGN == 0 and off + alloc.rounded(size) <= SEG
            held[name].append((off, off + alloc.rounded(size)))
    for name, spans in held.items():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"{name}: overlapping replicas {spans}"
        assert service.segments.get(name).allocator.used_bytes == sum(b - a for a, b in spans)


def test_recovery_keeps_the_first_of_two_overlapping_objects_and_frees_nothing_it_keeps(caplog):
    service = MasterService(MasterConfig())
    segs = [("s0:1", descriptor("s0", SEG), 1, SEG)]
    objs = [
        ("a", 4096, [("s0:1", 0)], None, 0),
        ("b", 4096, [("s0:1", 0)], None, 0),
        ("c", 4096, [("s0:1", 8192), ("s0:1", 8192)], 7, 2),
    ]
    with caplog.at_level(logging.WARNING):
        got = recovery.restore(service, segs, objs, 0.0)
    assert got == dict(
        segments=1, objects=2, dropped=1, pending=0, slab_bytes=0, manifest_objects=0, short=0, disk_only=0
    )
    assert service.table.get("b") is None and service.table.get("c").replicas == [("s0:1", 8192)]
    assert service.segments.get("s0:1").allocator.used_bytes == 8192
    assert any("'b'" in r.getMessage() for r in caplog.records)


def test_recovery_skips_segments_that_do_not_hold_together(caplog):
    service = MasterService(MasterConfig())
    segs = [
        ("s0:1", descriptor("s0", SEG), 1, SEG),
        ("s1:1", descriptor("s0", SEG), 1, SEG),  # another segment's descriptor under this name
        ("s2:7", descriptor("s2", SEG), 7, SEG),  # no region 7 in it
        ("s3:1", descriptor("s3", SEG), 1, 2 * SEG),
    ]  # larger than its region
    with caplog.at_level(logging.WARNING):
        got = recovery.restore(service, segs, [("k", 64, [("s1:1", 0)], None, 0)], 0.0)
    assert got == dict(
        segments=1, objects=0, dropped=1, pending=0, slab_bytes=0, manifest_objects=0, short=0, disk_only=0
    )
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"journal segment {n!r} skipped" in warned for n in ("s1:1", "s2:7", "s3:1"))


def test_task_records_load_and_hostile_ones_are_skipped(caplog):
    """Replica task records (issue #30): a valid one loads with its id, fields and in-flight destination;
    a wrong status, a string time, an id that is not two u64 and a non-msgpack value are skipped, each
    named in a warning."""
    good = ["copy", "k", "s:1", ["t:1"], "PROCESSING", 5, 6, "", ["t:1", 4096, 512]]
    items = {
        "/p/task/1-2": pack(good),
        "/p/task/3-4": pack([*good[:4], "RUNNING", *good[5:]]),
        "/p/task/5-6": pack([*good[:5], "5", *good[6:]]),
        f"/p/task/{1 << 64}-1": pack(good),
        "/p/task/7-8": b"\xc1",
    }
    with caplog.at_level(logging.WARNING, logger="kvplugins.store.master.ha.journal"):
        tasks = EtcdJournal(FakeEtcd(items), "/p").load_tasks()
    assert tasks == [((1, 2), "copy", "k", "s:1", ["t:1"], "PROCESSING", 5, 6, "", ("t:1", 4096, 512))]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(
        f"{k[len('/p/task/') :]!r} skipped" in warned or f"{k!r} skipped" in warned for k in items if k != "/p/task/1-2"
    )


def test_parked_records_load_and_hostile_ones_are_skipped(caplog):
    """Parked segment records (a removed segment's manifest kept, issue #34): a size loads; a negative size, a
    string and a non-msgpack value are skipped, each named in a warning."""
    items = {
        "/p/parked/s:1": pack(1 << 20),
        "/p/parked/a:1": pack(-1),
        "/p/parked/b:1": pack("x"),
        "/p/parked/c:1": b"\xc1",
    }
    with caplog.at_level(logging.WARNING, logger="kvplugins.store.master.ha.journal"):
        assert EtcdJournal(FakeEtcd(items), "/p").load_parked() == {"s:1": 1 << 20}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"{k!r} skipped" in warned for k in items if k != "/p/parked/s:1")


class _Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def test_a_recovered_segment_keeps_its_owner_so_its_paused_process_gets_its_objects_back():
    """An HA leader recovers each segment's owner (the journal's segowner record), so a node paused past the
    suspect grace under the new leader leaves a manifest and gets its objects back when it returns, and no other
    process may take the segment's name. Recovered segments had no owner: no manifest was kept, and the objects
    a paused node held last were lost (the 60 s SIGSTOP cluster run, issue #34)."""
    from kvplugins.store.master.segments import owner_digest
    from kvplugins.store.wire.protocol import EXISTS, OK

    clock = _Clock()
    service = MasterService(MasterConfig(heartbeat_timeout_ms=1000, suspect_grace_ms=1000), clock=clock)
    items = {"/p/segowner/s0:1": msgpack.packb([owner_digest("node-token"), ""]), "/p/segowner/bad": b"\xc1"}
    owners = EtcdJournal(FakeEtcd(items), "/p").load_owners()
    assert owners == {"s0:1": (owner_digest("node-token"), "")}
    recovery.restore(service, [("s0:1", descriptor("s0", SEG), 1, SEG)], [("k", 64, [("s0:1", 0)], 7, 0)], clock(),
                     (), owners)  # fmt: skip
    assert service.segments.get("s0:1").owner == owner_digest("node-token")
    entry = [[descriptor("s0", SEG), 1, SEG]]
    assert service.handle("register_segment", entry, {"owner": "another"})[0][0] == EXISTS  # not its process
    clock.t += 3.0
    service.tick()  # silent past the timeout and grace: removed, its manifest kept
    assert service.table.get("k") is None
    assert service.handle("register_segment", entry, {"owner": "node-token"}) == [[OK, "s0:1"]]
    assert service.table.get("k").replicas == [("s0:1", 0)]
