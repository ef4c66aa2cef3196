"""Coverage-guided fuzz (atheris, libFuzzer) of every decoder that reads bytes a peer or a disk controls (#11).

    python tests/fuzz/fuzz_decoders.py TARGET CORPUS_DIR [libFuzzer flags, e.g. -max_total_time=60]

TARGET is one of TARGETS below: the transfer wire (prefix, request and response headers), the master's request
envelope and op schemas, a node's promote endpoint, the HA journal's etcd values (and recovery of what decodes),
the disk tier's file headers, the security handshake. Seeds (valid inputs built with the real encoders, and the
hostile shapes of #11: deep nesting, huge announced lengths, invalid UTF-8) are written into CORPUS_DIR first,
then libFuzzer mutates them. A decoder may only fail with its documented error (ProtocolError, RefusedRequest,
CorruptFile, AuthError); any other exception, or a decoded value that breaks the decoder's promise (a range, a
round trip, bytes read back, allocators that match the recovered objects), is a finding: the process stops with
the input saved under ``-artifact_prefix``. A file path instead of CORPUS_DIR replays that one input.
kvplugins is instrumented function by function (``instrument``); what msgspec does in C is made visible to the
fuzzer through ``signal``. tests/fuzz/test_atheris.py runs each target for a bounded time in CI.
"""

from __future__ import annotations

import functools
import gc
import logging
import sys
import tempfile
import types
from pathlib import Path

import atheris

import msgpack
import msgspec

from kvplugins.errors import AuthError, ProtocolError
from kvplugins.security import handshake
from kvplugins.security.secret import Secret
from kvplugins.store.wire import protocol
from kvplugins.store.config import MasterConfig
from kvplugins.store.node.disk import files
from kvplugins.store.node.disk import server as promote_server
from kvplugins.store.master.ha import journal
from kvplugins.store.master.ha import recovery
from kvplugins.store.master.service import MasterService
from kvplugins.store.wire.schema import RefusedRequest, Schemas
from kvplugins.transfer import wire

MAX_FRAME = 16 << 20
SCHEMAS = Schemas(max_batch=64, max_key_bytes=64)
SECRET = Secret(b"fuzz-secret-fuzz-secret-fuzz-secret!", "fuzz")
SEP = b"\xc1"  # never valid msgpack: separates the values of one journal input
SEG_SIZE = 1 << 20
MARKERS = (
    "Expected `int`",
    "Expected `str`",
    "Expected `array`",
    "Expected `object`",
    "Expected `bool`",
    "length",
    ">=",
    "<=",
    "missing required field",
    "unknown field",
    "truncated",
    "malformed",
    "Invalid enum",
    "utf-8",
    "unknown op",
    "version",
    "payload",
    "frame limit",
    "max_key_bytes",
)


def signal(text: str) -> None:
    """Coverage for what happens inside the C decoders (msgspec), which atheris cannot see: one feature per
    kind of error (the marker it carries) and per depth of the path it names (``at `$[1][0].e```), so the
    fuzzer keeps inputs that get further into a structure. Instrumented by ``main``."""
    at = text.rfind("at `$")
    for _ in range(text.count("[", at) + text.count(".", at) if at >= 0 else 0):
        pass  # loop trip count: libFuzzer's hit-count buckets
    for marker in MARKERS:
        if marker in text:
            break


def signal_op(op: str) -> None:
    """One feature per op that decoded (the string compares also hand libFuzzer the op names)."""
    for name in sorted(SCHEMAS.types):
        if op == name:
            break


# ---- transfer wire ------------------------------------------------------------------------------------------
def fuzz_wire(data: bytes) -> None:
    """Input: n_entries (1 byte) + request id (8 bytes LE) + frame (16-byte prefix + header), as the server and
    the client see it: prefix, then the header as a request and as the response to (id, n_entries)."""
    if len(data) < 9 + wire.PREFIX.size:
        return
    n, req_id, frame = data[0], int.from_bytes(data[1:9], "little"), data[9:]
    try:
        hlen, plen = wire.parse_prefix(frame[: wire.PREFIX.size], MAX_FRAME)
    except ProtocolError:
        hlen, plen = len(frame), 0  # still feed the rest to the header decoders
    header = frame[wire.PREFIX.size : wire.PREFIX.size + hlen]
    try:
        _check_request(wire.decode_request(header, plen, MAX_FRAME), plen)
    except ProtocolError as e:
        signal(str(e))
    try:
        _check_response(wire.decode_response(header, req_id, n), req_id, n)
    except ProtocolError as e:
        signal(str(e))


def _check_request(req, plen: int) -> None:
    assert req.op in (wire.OP_WRITE, wire.OP_READ) and 0 <= req.req_id < 1 << 63
    assert 0 < len(req.entries) <= wire.MAX_ENTRIES
    assert all(0 <= r < 1 << 32 and 0 <= o < 1 << 63 and 0 <= n < 1 << 63 for r, o, n in req.entries)
    total = sum(e[2] for e in req.entries)
    assert plen == (total if req.op == wire.OP_WRITE else 0)
    assert req.op == wire.OP_WRITE or total <= wire.payload_limit(MAX_FRAME)
    again = wire.encode_request(req.op, req.req_id, list(req.entries), req.land_by_ms)
    assert wire.decode_request(again[wire.PREFIX.size :], plen, MAX_FRAME) == req  # canonical round trip


def _check_response(status, req_id: int, n: int) -> None:
    assert len(status) == n and all(s is None or (isinstance(s, str) and len(s) <= wire.MAX_STATUS) for s in status)
    again = wire.encode_response(req_id, status, 0)
    assert wire.decode_response(again[wire.PREFIX.size :], req_id, n) == status


# ---- master request envelope ---------------------------------------------------------------------------------
def fuzz_master(data: bytes) -> None:
    """A request body as the master's raw RPC endpoint (and its zmq control plane) receives it: typed decode
    (store/wire/schema.py), and the untyped envelope parser clients and tools share (protocol.unpack +
    parse_request)."""
    try:
        rid, op, entries, opts = SCHEMAS.decode(data)
    except (ProtocolError, RefusedRequest) as e:
        signal(str(e))
    else:
        signal_op(op)
        _check_typed(rid, op, entries, opts)
    try:
        protocol.parse_request(protocol.unpack(data))
    except ProtocolError:
        pass


def _check_typed(rid: int, op: str, entries, opts) -> None:
    """What decode accepted, the in-process path (convert) accepts as the same values."""
    assert 0 <= rid < 1 << 63 and op in SCHEMAS.types and len(entries) <= SCHEMAS.max_batch
    again = SCHEMAS.convert(op, msgspec.to_builtins(entries), msgspec.to_builtins(opts))
    assert msgspec.to_builtins(again) == msgspec.to_builtins((entries, opts)), (op, entries, opts)


# ---- a node's promote endpoint ------------------------------------------------------------------------------
def promote_endpoint():
    """The promote endpoint's request handling (store/node/disk/server.py ``_Server.answer``) without its socket: the
    real method on an instance that carries only what it reads (ops, schemas, max_batch)."""
    srv = object.__new__(promote_server._Server)
    srv.ops = {"promote": lambda entries, opts: [[k, True] for k in entries]}
    srv.schemas, srv.max_batch = promote_server.schemas(64), 64
    return srv


def fuzz_promote(srv, data: bytes) -> None:
    """A request body as a node's promote endpoint receives it: answered (ok or a refusal naming the field), or
    ProtocolError (the connection closes); nothing else."""
    try:
        reply = srv.answer(data, ("fuzz", 0))
    except ProtocolError as e:
        signal(str(e))
        return
    assert len(reply) == 4 and reply[0] == protocol.VERSION and isinstance(reply[2], bool)
    if not reply[2]:
        signal(reply[3])
    protocol.pack(reply)  # the reply can be sent


# ---- HA journal values read back from etcd -------------------------------------------------------------------
def fuzz_journal(data: bytes) -> None:
    """Up to 8 etcd values separated by SEP, each decoded as an object and as a segment; whatever decodes is
    recovered into a fresh master next to two known segments, which must never raise and never leave an
    allocator holding bytes no recovered replica owns."""
    segs, objs = [], []
    for i, value in enumerate(data.split(SEP)[:8]):
        try:
            objs.append((f"k{i}", *journal.decode_object(value)))
        except ProtocolError as e:
            signal(str(e))
        try:
            desc, region, size = journal.decode_segment(value)
            segs.append((f"{desc['segment_id']}:{region}" if i % 2 else f"x{i}", desc, region, size))
        except ProtocolError as e:
            signal(str(e))
    if not objs and not segs:
        return
    service = MasterService(MasterConfig())
    known = [(f"s{j}:1", _descriptor(f"s{j}"), 1, SEG_SIZE) for j in range(2)]
    got = recovery.restore(service, known + segs, objs, 0.0)
    assert got["objects"] + got["dropped"] == len(objs)
    _check_allocators(service, [o[0] for o in objs])


def _check_allocators(service, keys: list[str]) -> None:
    """Every allocator's used bytes are exactly those of the recovered objects' replicas in it."""
    owned = {seg.name: 0 for seg in service.segments}
    for obj in filter(None, map(service.table.get, keys)):
        for name, _ in obj.replicas:
            owned[name] += service.segments.get(name).allocator.rounded(obj.size)
    for seg in service.segments:
        assert seg.allocator.used_bytes == owned[seg.name], (seg.name, seg.allocator.used_bytes, owned[seg.name])


def _descriptor(segment_id: str, size: int = SEG_SIZE) -> dict:
    return {"v": 1, "segment_id": segment_id, "host_id": "h", "transports": {}, "regions": [[1, size, None]]}


# ---- disk tier file headers ----------------------------------------------------------------------------------
def fuzz_disk(root: Path, data: bytes) -> None:
    """Input: flags (1 byte) + a file's bytes, written under ``root`` and read back. Flags: 1 = fix the header
    checksum, 2 = fix the object checksum (so mutations reach the checks behind them), 4 = name the file after
    the key its header claims (else after "k")."""
    if not data:
        return
    flags, raw = data[0], bytearray(data[1:])
    if flags & 2 and len(raw) >= files.HEAD.size:
        klen = files.HEAD.unpack_from(raw)[2]
        files.HEAD.pack_into(
            raw, 0, *files.HEAD.unpack_from(raw)[:4], files.checksum(bytes(raw[files.data_offset(klen) :]))
        )
    if flags & 1 and len(raw) >= files.HEAD.size:
        end = files.HEAD.size + files.HEAD.unpack_from(raw)[2]
        if len(raw) >= end + files.CHECK.size:
            files.CHECK.pack_into(raw, end, files.checksum(bytes(raw[:end])))
    path = root / "objects" / files.file_name(_claimed_key(raw) if flags & 4 else "k")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    try:
        _read_back(path, raw)
    finally:
        path.unlink()


def _read_back(path: Path, raw: bytearray) -> None:
    """read_header + read_into of the file ``path`` holding ``raw``: CorruptFile, or exactly its bytes."""
    try:
        key, size, digest = files.read_header(path)
    except files.CorruptFile:
        return
    assert size == len(raw) - files.data_offset(len(key.encode())) and size <= files.MAX_OBJECT
    dest = bytearray(size)
    try:
        got = files.read_into(path, key, memoryview(dest))
    except files.CorruptFile:
        return
    assert got == digest and dest == raw[files.data_offset(len(key.encode())) :]  # never wrong bytes


def _claimed_key(raw: bytearray) -> str:
    if len(raw) < files.HEAD.size:
        return "k"
    klen = files.HEAD.unpack_from(raw)[2]
    try:
        return bytes(raw[files.HEAD.size : files.HEAD.size + klen]).decode() or "k"
    except UnicodeDecodeError:
        return "k"


# ---- security handshake --------------------------------------------------------------------------------------
def fuzz_handshake(data: bytes) -> None:
    """Input: chunk size (1 byte) + what a peer sends, fed to a server handshake in chunks as they arrive; and
    the whole input as a client's first read (check_refused). No exception is allowed from the server side."""
    if not data:
        return
    chunk, rest = data[0] % (handshake.MSG.size + 8) + 1, data[1:]
    hs, buf, outcome = handshake.ServerHandshake(SECRET), bytearray(), None
    for i in range(0, len(rest), chunk):
        buf += rest[i : i + chunk]
        out, outcome = hs.feed(buf)
        assert isinstance(out, bytes) and len(out) % handshake.MSG.size == 0
        if outcome is not None:
            break
    assert outcome is not True, "a peer without the secret authenticated"
    assert outcome is None or hs.reason
    try:
        handshake.check_refused(rest, "peer")
    except AuthError:
        pass


# ---- seeds ---------------------------------------------------------------------------------------------------
DEEP = b"\x91" * 3000 + b"\x01"  # 3000 nested one-item arrays: past Python's recursion limit


def _seeds_wire() -> list[bytes]:
    def framed(n: int, req_id: int, frame: bytes) -> bytes:
        return bytes([n]) + req_id.to_bytes(8, "little") + frame

    def raw(n: int, req_id: int, header: bytes) -> bytes:  # a hand-made header behind a valid prefix
        return framed(n, req_id, wire.PREFIX.pack(wire.MAGIC, len(header), 0) + header)

    return [
        framed(1, 7, wire.encode_request(wire.OP_WRITE, 7, [(1, 0, 8)])),
        framed(3, 9, wire.encode_request(wire.OP_READ, 9, [(1, 0, 8), (2, 1 << 40, 64), (0, 5, 0)])),
        framed(2, 7, wire.encode_response(7, [None, "region 3 is not exported"], 8)),
        framed(1, 1, wire.encode_response(1, [None], 0)),
        raw(1, 1, b"\x84\xa1v\x01\xa2op\x02\xa2id\x01\xa1e" + DEEP),  # deep nesting in a field
        raw(1, 1, b"\x85\xa1v\x01\xa2op\x02\xa2id\x01\xa2st\x91\xc0\xa1x" + DEEP),  # ... in an unknown one
        raw(1, 1, b"\x84\xa1v\x01\xa2op\x02\xa2id\x01\xa1e\xdd\xff\xff\xff\xff"),  # 4G entries announced
        raw(1, 1, msgpack.packb({"v": 1, "op": 3, "id": 1, "st": ["x" * 5000]})),
    ]


def _seeds_master() -> list[bytes]:
    desc = _descriptor("s0")
    requests = [
        ("info", [], {}),
        ("put_start", [["a", 100], ["b", 1]], {"replicas": 2, "pin": 1}),
        ("put_commit", ["a"], {"xxh3": [42]}),
        ("get", ["a", "b"], {"cols": True}),
        ("remove_by_regex", ["^a.*"], {"force": True}),
        ("report_corrupt", [["a", "s0:1", 0, 7]], {}),
        ("register_segment", [[desc, 1, 4096]], {}),
        ("heartbeat", ["s0:1"], {}),
        ("tier_register", [["s0:1", "tcp://h:1", 1 << 30, [["a", 100, 5]], "d"]], {"more": False}),
        ("tier_done", [["offload", "a", True, None]], {"segment": "s0:1"}),
        ("promote_commit", [["a", False, "gone"]], {"segment": "s0:1"}),
    ]
    seeds = [protocol.pack([protocol.VERSION, i + 1, op, e, o]) for i, (op, e, o) in enumerate(requests)]
    head = b"\x95\x01\x01" + msgpack.packb("put_commit")  # [1, 1, "put_commit", ...
    return seeds + [
        head + b"\x91\xa1a\x81\xa4xxh3\x91" + DEEP,  # the nested checksum
        head + DEEP + b"\x80",  # nested entries
        head + b"\xdd\xff\xff\xff\xff",
    ]  # 4G entries announced


def _seeds_promote() -> list[bytes]:
    head = b"\x95\x01\x01" + msgpack.packb("promote")
    return [
        protocol.pack([protocol.VERSION, 1, "promote", ["a", "b/c"], {}]),
        protocol.pack([protocol.VERSION, 2, "promote", [], {"x": 1}]),
        protocol.pack([protocol.VERSION, 3, "nope", ["a"], {}]),
        head + DEEP + b"\x80",  # nested entries
        head + b"\x91\xa2\xff\xfe\x80",
    ]  # a key that is not UTF-8


def _seeds_journal() -> list[bytes]:
    obj = msgpack.packb([100, [["s0:1", 0], ["s1:1", 4096]], 42, 2])
    seg = msgpack.packb([_descriptor("s2", 8192), 1, 8192])
    return [
        obj,
        seg,
        SEP.join([obj, msgpack.packb([64, [["s0:1", 0]], None, 0]), seg]),
        msgpack.packb([64, [["s0:1", 128]], None]),
        b"\x94\x40\x91\x92\xa4s0:1\x00" + DEEP + b"\x00",  # nested checksum
        msgpack.packb(["64", [["s0:1", 0]], None, 0]),
    ]  # a string size


def _seeds_disk() -> list[bytes]:
    key, data = "some/key", b"object bytes" * 8
    whole = files.header(key, len(data), files.checksum(data)) + data
    huge = bytearray(whole)
    files.HEAD.pack_into(huge, 0, files.MAGIC, files.VERSION, 0xFFFF, (1 << 64) - 1, 0)
    return [
        bytes([4]) + whole,
        bytes([7]) + whole,
        bytes([0]) + whole[: files.HEAD.size + 3],
        bytes([5]) + huge,
        bytes([7]) + whole[:-1],
    ]


def _seeds_handshake() -> list[bytes]:
    hello = handshake.message(handshake.HELLO, bytes(range(32)))
    proof = handshake.message(handshake.PROOF, mac=bytes(32))
    return [
        bytes([0]) + hello + proof,
        bytes([7]) + hello,
        bytes([200]) + handshake.message(handshake.REFUSED),
        bytes([3]) + hello[:40],
        bytes([0]) + hello + hello,
    ]


def instrument(package: str = "kvplugins") -> int:
    """Add coverage instrumentation to every loaded function of ``package`` (in place); returns how many.
    (atheris.instrument_imports() skips modules behind the editable install's custom loader, and
    instrument_all() spends ~15 s on numpy.)"""
    funcs = [
        f
        for f in gc.get_objects()
        if isinstance(f, types.FunctionType) and (f.__module__ or "").split(".")[0] == package
    ]
    for f in funcs + [signal, signal_op]:
        atheris.instrument_func(f)
    return len(funcs)


def targets(tmp: Path) -> dict:
    """target name -> (one-input function, seed builder)."""
    return {
        "wire": (fuzz_wire, _seeds_wire),
        "master": (fuzz_master, _seeds_master),
        "promote": (functools.partial(fuzz_promote, promote_endpoint()), _seeds_promote),
        "journal": (fuzz_journal, _seeds_journal),
        "disk": (functools.partial(fuzz_disk, tmp), _seeds_disk),
        "handshake": (fuzz_handshake, _seeds_handshake),
    }


TARGETS = ("wire", "master", "promote", "journal", "disk", "handshake")


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] not in TARGETS:
        sys.exit(f"usage: {argv[0]} {{{'|'.join(TARGETS)}}} CORPUS_DIR|INPUT_FILE [libFuzzer flags]")
    corpus = Path(argv[2])
    # the disk target's files go next to the corpus (libFuzzer exits without running Python's clean-ups)
    scratch = corpus.with_name(corpus.name + ".scratch") if corpus.is_dir() else Path(tempfile.mkdtemp())
    one, seeds = targets(scratch)[argv[1]]
    if corpus.is_dir():
        for i, seed in enumerate(seeds()):
            (corpus / f"seed-{i}").write_bytes(seed)
    logging.disable(logging.CRITICAL)  # recovery's per-input warnings would flood the output
    print(f"INFO: instrumented {instrument()} kvplugins functions", file=sys.stderr)
    atheris.Setup([argv[0], *argv[3:], str(corpus)], one)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
