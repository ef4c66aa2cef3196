"""EtcdJournal: the master's Journal hooks (master/journal.py) persisted in etcd. Between ``begin()`` and
``commit()`` (the leader guard opens a batch per op, or per loop turn with group commit) the hooks' writes are
collected and persisted at the commit, before any reply of those ops is sent, in one fenced transaction per
MAX_TXN_OPS keys; outside a batch each hook writes at once. Either way a put_commit is durable in etcd before
the master acknowledges it.

Fencing: every transaction compares ``{prefix}/leader`` with this master's leader value; if another master
leads now, nothing is written, ``on_fenced`` steps this one down and the op answers an error (the client
retries on the new leader). A transient etcd failure is retried for up to RETRY_S, then raises StoreError.

Read back (``load``, on election) every value is decoded into the same typed, range-checked shapes as the
master's wire (store/wire/schema.py, issue #11); one that does not fit is skipped with a warning naming its key.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import time
from typing import Annotated, Literal, Union

import msgpack
import msgspec
from msgspec import Meta

from kvplugins.errors import ProtocolError, StoreError
from kvplugins.store.wire import schema
from kvplugins.store.cluster.etcd import MAX_TXN_OPS, delete_op, put_op
from kvplugins.store.master.journal import Journal
from kvplugins.store.placement import PIN_CODES

log = logging.getLogger(__name__)
RETRY_S = 1.0
LATER_PER_TURN = 2048  # deferred record rewrites (replicas_lost, records_gone) persisted a loop turn: 16 txns
MAX_JOURNAL_KEY = 1 << 16  # characters of an object key or segment name read back from etcd


class EtcdJournal(Journal):
    """Persist committed placement under ``prefix`` of ``etcd`` (ha.etcd.Etcd). ``fence``: the leader value
    writes are conditional on (set by the leader guard); ``on_fenced(why)``: called when that no longer holds."""

    keeps = True

    def __init__(self, etcd, prefix: str):
        super().__init__()
        self.etcd, self.prefix = etcd, prefix.rstrip("/")
        self.fence: bytes = b""
        self.on_fenced = None
        self._batch: dict | None = None
        # etcd key -> (object to rewrite, or None: delete the record; {removed segments the record still names})
        self._later: dict[str, tuple] = {}

    @property
    def leader_key(self) -> str:
        return self.prefix + "/leader"

    def obj_key(self, key: str) -> str:
        return f"{self.prefix}/obj/{key}"

    def seg_key(self, name: str) -> str:
        return f"{self.prefix}/seg/{name}"

    def owner_key(self, name: str) -> str:
        return f"{self.prefix}/segowner/{name}"

    def slab_key(self, slab_id: int) -> str:
        return f"{self.prefix}/slab/{int(slab_id)}"

    def parked_key(self, name: str) -> str:
        return f"{self.prefix}/parked/{name}"

    def flight_key(self, fid: int) -> str:
        return f"{self.prefix}/flight/{int(fid)}"

    def task_key(self, task_id) -> str:
        hi, lo = task_id
        return f"{self.prefix}/task/{int(hi)}-{int(lo)}"

    # ---- hooks ---------------------------------------------------------------------------------------
    def committed(self, objs: list) -> None:
        self._write({self.obj_key(o.key): put_op(self.obj_key(o.key), encode_object(o, self.wanted(o))) for o in objs})

    def replicas_changed(self, objs: list) -> None:
        self.committed(objs)

    def replicas_lost(self, objs: list, segment: str) -> None:
        """Deferred: a segment that held 110,000 objects cost the leader one etcd write each in one turn (~5 s
        without an answer; three at once outlived a 15 s stop). ``rewrite_some`` persists LATER_PER_TURN a turn,
        each from the object as it is then; any other write of the key supersedes it (``_write``)."""
        for o in objs:
            k = self.obj_key(o.key)
            self._later[k] = (o, self._later.get(k, (None, frozenset()))[1] | {segment})

    def records_gone(self, keys: list[str], segments) -> None:
        """Deferred like replicas_lost: the last replicas of 240,000 objects leaving with three nodes at a cluster's
        stop cost the leader ~1,900 etcd transactions in one turn, past the 15 s it had to stop."""
        for key in keys:
            k = self.obj_key(key)
            self._later[k] = (None, self._later.get(k, (None, frozenset()))[1] | frozenset(segments))

    def pending_rewrites(self) -> int:
        """Records replicas_lost deferred that are not persisted yet."""
        return len(self._later)

    def drop_deferred(self) -> None:
        """Forget the deferred rewrites (a leadership term ends or begins: they describe the old term's objects,
        and a new leader's recovery finds the records that still name removed segments itself)."""
        self._later.clear()

    def pending(self, objs) -> None:
        self.committed(objs)  # encode_object carries the pending flag

    def slab_added(self, slab) -> None:
        value = msgpack.packb([slab.seg.name, slab.front, slab.end])
        self._write({self.slab_key(slab.id): put_op(self.slab_key(slab.id), value)})

    def slab_removed(self, slab_id: int) -> None:
        self._write({self.slab_key(slab_id): delete_op(self.slab_key(slab_id))})

    def flight_started(self, fid: int, segment: str, start: int, end: int) -> None:
        self._write({self.flight_key(fid): put_op(self.flight_key(fid), msgpack.packb([segment, start, end]))})

    def flight_ended(self, fid: int) -> None:
        self._write({self.flight_key(fid): delete_op(self.flight_key(fid))})

    def removed(self, objs: list) -> None:
        self._write({self.obj_key(o.key): delete_op(self.obj_key(o.key)) for o in objs})

    def task_changed(self, task) -> None:
        self._write({self.task_key(task.id): put_op(self.task_key(task.id), encode_task(task))})

    def task_forgotten(self, task_id) -> None:
        self._write({self.task_key(task_id): delete_op(self.task_key(task_id))})

    def segment_added(self, seg) -> None:
        named = [k for k, (_, segs) in self._later.items() if seg.name in segs]  # its name is live again: first
        if named:  # the records still naming its old incarnation are rewritten, in the same batch
            self._write(self._rewrites(named))
        value = msgpack.packb([seg.descriptor, seg.region_id, seg.size])
        owner = msgpack.packb([seg.owner, seg.identity])  # who may re-register it, and get its manifest back
        self._write(
            {
                self.seg_key(seg.name): put_op(self.seg_key(seg.name), value),
                self.owner_key(seg.name): put_op(self.owner_key(seg.name), owner),
            }
        )

    def segment_parked(self, seg) -> None:
        self._write(
            {
                self.seg_key(seg.name): delete_op(self.seg_key(seg.name)),
                self.parked_key(seg.name): put_op(self.parked_key(seg.name), msgpack.packb(seg.size)),
            }
        )

    def manifest_dropped(self, name: str, keys: list[str], forget_owner: bool) -> None:
        ops = {self.parked_key(name): delete_op(self.parked_key(name))}
        if forget_owner:
            ops[self.owner_key(name)] = delete_op(self.owner_key(name))
        ops.update({self.obj_key(k): delete_op(self.obj_key(k)) for k in keys})
        self._write(ops)

    def segment_removed(self, name: str) -> None:
        self._write(
            {self.seg_key(name): delete_op(self.seg_key(name)), self.owner_key(name): delete_op(self.owner_key(name))}
        )

    # ---- load ----------------------------------------------------------------------------------------
    def load(self) -> tuple[list, list, list]:
        """([(name, wire, region id, size)], [(key, size, [(segment, offset)], checksum, pin, pending, wanted)],
        [(slab id, segment, start, end)]), objects oldest first. Raises StoreError."""
        cut = len(self.prefix) + len("/seg/")  # == len("/obj/")
        segs = _decoded(self.etcd.range_prefix(self.prefix + "/seg/"), cut, decode_segment)
        objs = _decoded(self.etcd.range_prefix(self.prefix + "/obj/"), cut, decode_object)
        slabs = _decoded(self.etcd.range_prefix(self.prefix + "/slab/"), len(self.prefix) + len("/slab/"), decode_slab)
        return segs, objs, slabs

    def load_owners(self) -> dict[str, tuple[bytes, str]]:
        """Segment name -> (owner digest, named credential) of each journaled segment (decode_owner). Raises
        StoreError."""
        cut = len(self.prefix) + len("/segowner/")
        return {name: (owner, ident) for name, owner, ident in _decoded(
            self.etcd.range_prefix(self.prefix + "/segowner/"), cut, decode_owner)}  # fmt: skip

    def load_parked(self) -> dict[str, int]:
        """Segment name -> size (bytes) of each parked segment (segment_parked): removed for silence, its manifest
        kept. Raises StoreError."""
        cut = len(self.prefix) + len("/parked/")
        return {
            name: size for name, size in _decoded(self.etcd.range_prefix(self.prefix + "/parked/"), cut, decode_parked)
        }

    def load_flights(self) -> list[tuple]:
        """[(flight id, segment, start, end)] of the disk-tier flights journaled (the same value as a slab's).
        Raises StoreError."""
        out = []
        for name, *fields in _decoded(
            self.etcd.range_prefix(self.prefix + "/flight/"), len(self.prefix) + len("/flight/"), decode_slab
        ):
            if name.isdigit() and int(name) < 1 << 64:
                out.append((int(name), *fields))
            else:
                log.warning("journal entry %r skipped: not a flight id", self.flight_key(0)[:-1] + name[:200])
        return out

    def load_tasks(self) -> list[tuple]:
        """[((hi, lo), kind, key, source, targets, status, created ms, updated ms, message, dest)] of the replica
        tasks journaled (decode_task), oldest update first. Raises StoreError."""
        cut = len(self.prefix) + len("/task/")
        out = []
        for name, *fields in _decoded(self.etcd.range_prefix(self.prefix + "/task/"), cut, decode_task):
            hi, _, lo = name.partition("-")
            if hi.isdigit() and lo.isdigit() and int(hi) < 1 << 64 and int(lo) < 1 << 64:
                out.append(((int(hi), int(lo)), *fields))
            else:
                log.warning("journal entry %r skipped: not a task id", name[:200])
        return sorted(out, key=lambda t: t[7])

    def begin(self) -> None:
        """Collect the hooks' writes from now on (a later write of a key supersedes an earlier one) until
        ``commit``; a no-op while a batch is open."""
        if self._batch is None:
            self._batch = {}

    def commit(self) -> None:
        """Persist the open batch (if any) and close it. Raises StoreError if it could not be persisted."""
        ops, self._batch = self._batch, None
        if ops:
            self._flush(ops)

    def rewrite_some(self) -> None:
        """Persist up to LATER_PER_TURN deferred rewrites (replicas_lost, records_gone), oldest first, outside any batch (the
        leader guard calls it once a loop turn, after the turn's commit); a failure keeps them for the next turn."""
        if self._later and self._batch is None:
            keys = list(itertools.islice(self._later, LATER_PER_TURN))
            todo = {k: self._later[k] for k in keys}
            try:
                self._flush(self._rewrites(keys))
            except StoreError as e:
                log.warning("%d deferred record rewrites not persisted (retried next turn): %s", len(keys), e)
                for k, v in todo.items():
                    self._later.setdefault(k, v)

    def _rewrites(self, keys: list[str]) -> dict:
        """put (or delete) ops of deferred rewrites ``keys`` (taken out of the deferred set), from their objects now."""
        objs = [self._later.pop(k)[0] for k in keys]
        return {
            k: delete_op(k) if o is None else put_op(k, encode_object(o, self.wanted(o))) for k, o in zip(keys, objs)
        }

    @contextlib.contextmanager
    def batch(self):
        """begin() ... commit() around the block; inside an open batch, the outer commit persists the writes."""
        if self._batch is not None:
            yield
            return
        self.begin()
        try:
            yield
        finally:
            self.commit()

    def _write(self, ops: dict) -> None:
        if self._later:
            for k in ops:  # a newer write of the key: its deferred rewrite is moot
                self._later.pop(k, None)
        if self._batch is not None:
            self._batch.update(ops)
        else:
            self._flush(ops)

    def _flush(self, ops: dict) -> None:
        ops = list(ops.values())
        for i in range(0, len(ops), MAX_TXN_OPS):
            self._txn(ops[i : i + MAX_TXN_OPS])

    def _txn(self, ops: list) -> None:
        deadline = time.monotonic() + RETRY_S
        while True:
            try:
                ok = self.etcd.txn([self.etcd.value_is(self.leader_key, self.fence)], ops)
                break
            except StoreError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        if not ok:
            if self.on_fenced is not None:
                self.on_fenced("another master holds the leader key")
            raise StoreError(
                f"not leader: {self.leader_key} no longer holds this master's value; "
                "the metadata change was not persisted"
            )


def encode_object(obj, wanted: int = 0) -> bytes:
    """msgpack [size, [[segment, offset], ...], checksum or None, 2 if hard-pinned else 0, 1 if pending (a
    put_start not committed yet) else 0] (a soft pin's TTL and a put's deadline are master-clock times and are
    not kept), then ``wanted`` (the replica count re-replication owes it) where that exceeds its replicas."""
    hard = PIN_CODES["hard"] if obj.pin == PIN_CODES["hard"] else 0
    value = [obj.size, [list(r) for r in obj.replicas], obj.checksum, hard, 0 if obj.complete else 1]
    if wanted > len(obj.replicas):
        value.append(wanted)
    return msgpack.packb(value)


class _ObjectValue(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    size: schema.Size
    # none for a disk-only object (tiering.to_disk_only; recovery.py restores it awaiting its nodes' tiers)
    replicas: Annotated[list[tuple[schema.SegName, schema.Offset]], Meta(max_length=64)]
    checksum: Union[schema.U64, None] = None
    pin: Literal[0, 2] = 0
    pending: Literal[0, 1] = 0
    wanted: Annotated[int, Meta(ge=0, le=64)] = 0


_OBJECT = msgspec.msgpack.Decoder(_ObjectValue)
_SEGMENT = msgspec.msgpack.Decoder(tuple[schema.Descriptor, schema.RegionId, schema.Size])
_OWNER = msgspec.msgpack.Decoder(tuple[bytes, str])
_PARKED = msgspec.msgpack.Decoder(schema.Size)
_SLAB = msgspec.msgpack.Decoder(tuple[schema.SegName, schema.Offset, schema.Offset])


class _TaskValue(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    kind: Literal["copy", "move"]
    key: Annotated[str, Meta(min_length=1, max_length=MAX_JOURNAL_KEY)]
    source: schema.SegName
    targets: Annotated[list[schema.SegName], Meta(max_length=schema.MAX_TARGETS)]
    status: Literal["PENDING", "PROCESSING", "SUCCESS", "FAILED"]
    created_ms: schema.U64
    updated_ms: schema.U64
    message: Annotated[str, Meta(max_length=4096)]
    dest: Union[tuple[schema.SegName, schema.Offset, schema.Size], None] = None


_TASK = msgspec.msgpack.Decoder(_TaskValue)
_OBJECT_FIELDS = ("size", "replicas", "checksum", "pin", "pending", "wanted")
_SEGMENT_FIELDS = ("descriptor", "region id", "size")


def decode_object(value: bytes) -> tuple:
    """(size in bytes, [(segment, offset)], checksum or None, pin, pending, wanted) from encode_object's bytes. Raises
    ProtocolError naming the field (``replicas: Expected `int` >= 0 - at `$[1][0][1]```) for a value that is
    not one (typed: msgspec, as the master's wire)."""
    try:
        o = _OBJECT.decode(value)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"journal object value: {_named(e, _OBJECT_FIELDS)}") from None
    return o.size, o.replicas, o.checksum, o.pin, o.pending, o.wanted


def decode_segment(value: bytes) -> tuple:
    """(descriptor wire dict, region id, size in bytes) from segment_added's bytes. Raises ProtocolError naming
    the field."""
    try:
        desc, region_id, size = _SEGMENT.decode(value)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"journal segment value: {_named(e, _SEGMENT_FIELDS)}") from None
    return desc.wire(), region_id, size


def decode_owner(value: bytes) -> tuple:
    """(owner digest: b"" or 32 bytes, named credential) from segment_added's owner record. Raises ProtocolError."""
    try:
        owner, ident = _OWNER.decode(value)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"journal segment owner value: {e}") from None
    if len(owner) not in (0, 32) or len(ident) > MAX_JOURNAL_KEY:
        raise ProtocolError(f"journal segment owner value: a {len(owner)}-byte digest or a credential too long")
    return owner, ident


def decode_parked(value: bytes) -> tuple:
    """(segment size,) from segment_parked's record. Raises ProtocolError."""
    try:
        return (_PARKED.decode(value),)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"journal parked segment value: {e}") from None


def decode_slab(value: bytes) -> tuple:
    """(segment name, start, end) from slab_added's bytes. Raises ProtocolError for a value that is not one."""
    try:
        seg, start, end = _SLAB.decode(value)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"journal slab value: {e}") from None
    if not start < end:
        raise ProtocolError(f"journal slab value: start {start} is not below end {end}")
    return seg, start, end


def encode_task(task) -> bytes:
    """msgpack [kind, key, source, targets not done yet, status, created ms, updated ms (wall clock), message,
    [segment, offset, size] of the write in flight or None] of a replica task (replica_tasks.Task)."""
    dest = None
    if task.flight is not None and task.flight.dest is not None:
        seg, off = task.flight.dest
        dest = [seg.name, off, task.flight.size]
    return msgpack.packb(
        [
            task.kind,
            task.key,
            task.source,
            list(task.targets),
            task.status,
            task.created_ms,
            task.updated_ms or task.created_ms,
            task.message[:4096],
            dest,
        ]
    )


def decode_task(value: bytes) -> tuple:
    """(kind, key, source, targets, status, created ms, updated ms, message, dest or None) from encode_task's
    bytes. Raises ProtocolError naming what does not fit."""
    try:
        t = _TASK.decode(value)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"journal task value: {e}") from None
    return t.kind, t.key, t.source, t.targets, t.status, t.created_ms, t.updated_ms, t.message, t.dest


def _named(err: Exception, fields: tuple[str, ...]) -> str:
    """msgspec's error text prefixed with the name of the top-level array item its path starts at."""
    text = str(err)
    at = re.search(r"at `\$\[(\d+)\]", text)
    return f"{fields[int(at.group(1))]}: {text}" if at and int(at.group(1)) < len(fields) else text


def _decoded(items, cut: int, decode) -> list[tuple]:
    """[(name, *decode(value))] of etcd (key, value) items; a value that does not decode (written by another
    version, or by someone else with write access to the prefix) is skipped with a warning naming its etcd
    key: recovery never applies part of one, and never stops on one. So is a name that is empty, longer than
    MAX_JOURNAL_KEY characters, or not UTF-8 (an etcd key read with errors="surrogateescape")."""
    out = []
    for k, v in items:
        name = k[cut:]
        try:
            _check_name(name)
            out.append((name, *decode(v)))
        except ProtocolError as e:
            log.warning("journal entry %r skipped: %s", k[:200], e)
    return out


def _check_name(name: str) -> None:
    """Raise ProtocolError unless ``name`` (an object key or segment name from an etcd key) is 1..MAX_JOURNAL_KEY
    characters of valid UTF-8."""
    if not 0 < len(name) <= MAX_JOURNAL_KEY:
        raise ProtocolError(f"name of {len(name)} characters (1..{MAX_JOURNAL_KEY})")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise ProtocolError("name is not UTF-8") from None
