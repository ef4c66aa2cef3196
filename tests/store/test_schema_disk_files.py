"""The disk tier's file headers (#11), one field at a time: magic, version, key length, size, object checksum,
header checksum and the key each get a wrong, zero, huge or hostile value (with the header checksum recomputed,
so the range checks themselves are reached, or not), the file is cut at any byte or grown, or renamed under
another key. ``read_header``/``read_into`` either return exactly what was written or raise CorruptFile naming
the field; never another exception, an allocation beyond the file, or wrong bytes. DiskStore (its callers'
handling) deletes and counts such a file at start and on read."""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvplugins.store.node.disk import files
from kvplugins.store.node.disk.files import CorruptFile
from kvplugins.store.node.disk.store import DiskStore

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
U16, U64 = 0xFFFF, (1 << 64) - 1
FIELDS = ("magic", "version", "klen", "size", "digest")


def make(key: str, data: bytes) -> bytes:
    return files.header(key, len(data), files.checksum(data)) + data


def parts(raw: bytes) -> dict:
    """The fields of a file's bytes (as written by ``make``)."""
    magic, version, klen, size, digest = files.HEAD.unpack_from(raw)
    end = files.HEAD.size + klen
    return {
        "magic": magic,
        "version": version,
        "klen": klen,
        "size": size,
        "digest": digest,
        "key": raw[files.HEAD.size : end],
        "check": raw[end : end + 8],
        "data": raw[end + 8 :],
    }


def assemble(p: dict, fix_check: bool) -> bytes:
    head = files.HEAD.pack(p["magic"], p["version"], p["klen"], p["size"], p["digest"]) + p["key"]
    return head + (files.CHECK.pack(files.checksum(head)) if fix_check else p["check"]) + p["data"]


def write(root: Path, raw: bytes, key: str) -> Path:
    """``raw`` as the file of ``key`` under ``root``'s objects directory."""
    path = root / "objects" / files.file_name(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    return path


def read(path: Path, size_hint: int):
    """(key, size, digest, bytes) read back, or the CorruptFile; any other exception propagates (a bug)."""
    try:
        key, size, digest = files.read_header(path)
    except CorruptFile as e:
        return e
    assert size <= size_hint, "read_header accepted a size beyond the file"
    dest = bytearray(size)
    try:
        assert files.read_into(path, key, memoryview(dest)) == digest
    except CorruptFile as e:
        return e
    return key, size, digest, bytes(dest)


keys = st.text(min_size=1, max_size=40).filter(lambda k: len(k.encode()) <= U16)
payloads = st.binary(min_size=0, max_size=300)
hostile_int = st.one_of(
    st.just(0),
    st.just(1),
    st.integers(0, 64),
    st.sampled_from([U16, 1 << 48, (1 << 48) + 1, 1 << 63, U64]),
    st.integers(0, U64),
)


@SETTINGS
@given(keys, payloads, st.sampled_from(FIELDS), st.data(), st.booleans())
def test_header_field_replaced(tmp_path, key, data, field, draw, fix_check):
    p = parts(make(key, data))
    top = {"magic": None, "version": U16, "klen": U16, "size": U64, "digest": U64}[field]
    p[field] = (
        draw.draw(st.binary(min_size=4, max_size=4)) if top is None else draw.draw(hostile_int.map(lambda n: n & top))
    )
    raw = assemble(p, fix_check)
    got = read(write(tmp_path, raw, key), len(raw))
    original = parts(make(key, data))
    if not isinstance(got, CorruptFile):  # read back only if the field kept its written value
        assert p[field] == original[field] and got == (key, len(data), files.checksum(data), data)
        return
    message = str(got)
    if p["magic"] != files.MAGIC or p["version"] != files.VERSION:
        assert "not a kvplugins disk-tier file" in message
    elif field == "klen" and p["klen"] == 0:
        assert "key length 0 outside" in message
    elif field in ("klen", "size") and p[field] != original[field]:
        assert "!= header +" in message or "header checksum mismatch" in message
    elif field == "digest":
        assert "object checksum mismatch" in message or "header checksum mismatch" in message
    else:
        assert "header checksum mismatch" in message


@SETTINGS
@given(keys, payloads, st.data())
def test_truncated_or_grown_files(tmp_path, key, data, draw):
    raw = make(key, data)
    cut = draw.draw(st.integers(0, len(raw)))
    grown = raw + draw.draw(st.binary(min_size=1, max_size=64))
    for bad in (raw[:cut], grown):
        if bad == raw:
            continue
        got = read(write(tmp_path, bad, key), len(bad))
        assert isinstance(got, CorruptFile), bad
        assert any(m in str(got) for m in ("truncated header", "!= header +", "key length 0"))


@SETTINGS
@given(keys, payloads, st.integers(0, 255))
def test_flipped_object_or_key_byte(tmp_path, key, data, pos):
    raw = bytearray(make(key, data))
    pos = files.HEAD.size + pos % (len(raw) - files.HEAD.size)
    raw[pos] ^= 0x5A
    got = read(write(tmp_path, bytes(raw), key), len(raw))
    assert isinstance(got, CorruptFile) and "checksum mismatch" in str(got)


@SETTINGS
@given(keys, keys, payloads)
def test_file_under_another_keys_name(tmp_path, key, other, data):
    got = read(write(tmp_path, make(key, data), other), 1 << 20)
    if files.file_name(key) == files.file_name(other):
        assert got == (key, len(data), files.checksum(data), data)
    else:
        assert isinstance(got, CorruptFile) and "whose file is" in str(got)


@SETTINGS
@given(st.binary(min_size=1, max_size=64), payloads)
def test_key_that_is_not_utf8_with_valid_checksums(tmp_path, kb, data):
    p = parts(make("k", data))
    p["key"], p["klen"] = kb, len(kb)
    raw = assemble(p, fix_check=True)
    try:
        key = kb.decode()
    except UnicodeDecodeError:
        got = read(write(tmp_path, raw, "k"), len(raw))
        assert isinstance(got, CorruptFile) and "key is not UTF-8" in str(got)
        return
    assert read(write(tmp_path, raw, key), len(raw)) == (key, len(data), files.checksum(data), data)


def test_hostile_sizes_never_allocate_or_read_past_the_file(tmp_path):
    raw = make("k", b"x" * 10)
    for klen, size in [(U16, 10), (1, U64), (1, 1 << 48), (1, (1 << 48) + 1), (U16, U64), (0, 0)]:
        p = parts(raw)
        p["klen"], p["size"] = klen, size
        got = read(write(tmp_path, assemble(p, fix_check=True), "k"), len(raw))
        assert isinstance(got, CorruptFile), (klen, size)
        assert "key length 0" in str(got) if klen == 0 else "!= header +" in str(got)


def test_read_into_refuses_a_different_key_or_size(tmp_path):
    path = write(tmp_path, make("k", b"abc"), "k")
    for key, n in [("other", 3), ("k", 2), ("k", 4)]:
        with pytest.raises(CorruptFile, match="expected"):
            files.read_into(path, key, memoryview(bytearray(n)))


def test_writer_refuses_what_the_reader_would(tmp_path):
    for key, size in [("", 1), ("k" * (U16 + 1), 1), ("k", (1 << 48) + 1)]:
        with pytest.raises(files.StoreError, match="does not fit the disk tier"):
            files.header(key, size, 0)
    assert files.header("k", 0, 0)  # an empty object is representable


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(FIELDS + ("cut", "ok")), st.integers(0, U64)), min_size=1, max_size=6))
def test_disk_store_discards_and_counts_every_bad_file(tmp_path, edits):
    """The tier's callers: a scan at start deletes and counts each bad file; the good ones stay readable."""
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        check_disk_store(Path(tmp), edits)


def check_disk_store(root: Path, edits: list) -> None:
    good = {}
    for i, (field, n) in enumerate(edits):
        key, data = f"key{i}", bytes([i]) * (10 + i)
        raw = make(key, data)
        if field == "cut":
            raw = raw[: n % len(raw)]
        elif field != "ok":
            p = parts(raw)
            p[field] = (
                struct.pack("<I", n & 0xFFFFFFFF)
                if field == "magic"
                else n & (U16 if field in ("version", "klen") else U64)
            )
            raw = assemble(p, fix_check=bool(n & 1))
        if raw == make(key, data):
            good[key] = data
        write(root, raw, key)
    store = DiskStore(root, 1 << 30)
    stored = {e[0] for e in store.entries()}
    corrupt = store.stats()["disk_corrupt"]
    assert set(good) <= stored and corrupt == len(edits) - len(stored)
    for key in stored:
        dest = bytearray(store.size_of(key))
        try:
            store.read_into(key, memoryview(dest))
            assert bytes(dest) == good[key]
        except CorruptFile:  # a wrong digest passes the header, never the read
            assert key not in good
