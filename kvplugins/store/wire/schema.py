"""Typed schemas of the master's ops (issue #11): every request is decoded straight from msgpack into typed,
range-checked values (msgspec) before anything is applied or stored, so a hostile or buggy client cannot store a
value the master later fails on (a nested checksum, a string size) or make it walk unbounded input.

Request body ``[VERSION, request id, op, entries, opts]`` (protocol.py). Per op:
  entries  a list of at most ``max_batch`` items of the op's entry type below;
  opts     a map of the op's options; an unknown option is an error (a typo is never silently ignored).
Keys are non-empty strings of at most ``max_key_bytes`` UTF-8 bytes; sizes are ints in (0, MAX_SIZE]; offsets
in [0, MAX_SIZE); checksums are xxh3_64 digests (ints in [0, 2**64)); segment names and endpoints are strings
of at most MAX_NAME characters. A request that breaks any of it fails whole, before anything is applied, with
an error naming the op and the path of the field (``put_start: entries: Expected `int`, got `str` - at
`$[3][1]```); the connection stays open. A body that is not a 5-array of this shape raises ProtocolError
(the server closes that connection).

Two ways in, one set of types: ``Schemas.decode`` (the RPC server: bytes -> typed, one pass) and
``Schemas.convert`` (in-process callers of MasterService.handle: Python objects -> the same typed values).
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable, Iterable
from typing import Annotated, Literal, Protocol, Union

import msgspec
from msgspec import Meta, Raw, Struct

from kvplugins.errors import ProtocolError
from kvplugins.security import roles
from kvplugins.store.wire.protocol import VERSION

MAX_SIZE = 1 << 48  # 256 TiB: no object, segment or offset is larger
MAX_NAME = 256  # segment names, host ids, endpoints, error details (characters)
MAX_DETAIL = 4096  # error text a node reports (characters)
MAX_PATTERN = 4096  # remove_by_regex pattern (characters)
MAX_FILE_KEY = 1 << 16  # keys of files a node announces (its disk tier checks them on write)
MAX_FILES = 1 << 20  # files in one tier_register entry
MAX_DESC_REGIONS = 1024  # regions in one segment descriptor
MAX_TRANSPORT_FIELDS = 16  # fields of one transport's endpoint info in a descriptor
MAX_TARGETS = 64  # target segments of one replica copy task
MAX_NICS = 16  # RDMA NICs one descriptor lists (endpoint lists, rkeys per region)

U64 = Annotated[int, Meta(ge=0)]  # msgpack carries at most 2**64 - 1
Size = Annotated[int, Meta(gt=0, le=MAX_SIZE)]
Offset = Annotated[int, Meta(ge=0, lt=MAX_SIZE)]
Capacity = Annotated[int, Meta(ge=0, le=MAX_SIZE)]
RegionId = Annotated[int, Meta(ge=0, lt=1 << 32)]
Name = Annotated[str, Meta(max_length=MAX_NAME)]
SegName = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
Detail = Union[U64, Annotated[str, Meta(max_length=MAX_DETAIL)], None]
Scalar = Union[Name, int, float, bool, None]


class Envelope(Struct, array_like=True, forbid_unknown_fields=True):
    """The request body; entries and opts stay raw until the op is known."""

    version: int
    rid: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
    op: Annotated[str, Meta(max_length=64)]
    entries: Raw
    opts: Raw


class NoOpts(Struct, forbid_unknown_fields=True):
    pass


class PutStartOpts(Struct, forbid_unknown_fields=True):
    """store/placement.py PutConfig.wire: replicas, preferred segment, pin code (0 none, 1 soft, 2 hard)."""

    replicas: Annotated[int, Meta(ge=1, le=64)] = 1
    segment: Name = ""
    pin: Literal[0, 1, 2] = 0
    pin_ttl_ms: Annotated[int, Meta(ge=0, le=1 << 40)] = 0


class CommitOpts(Struct, forbid_unknown_fields=True):
    xxh3: Union[list[Union[U64, None]], None] = None  # one per entry


class ReserveOpts(Struct, forbid_unknown_fields=True):
    release: Annotated[list[U64], Meta(max_length=64)] = []  # slab ids whose remainder goes back


class GetOpts(Struct, forbid_unknown_fields=True):
    cols: Union[bool, Literal[0, 1]] = False


class ForceOpts(Struct, forbid_unknown_fields=True):
    force: bool = False


class RemoveCheckedOpts(Struct, forbid_unknown_fields=True):
    """remove_checked: ``force`` past read leases; ``segment``: only the replicas on that segment ('' = all)."""

    force: bool = False
    segment: Name = ""


class MoreOpts(Struct, forbid_unknown_fields=True):
    more: Union[bool, Literal[0, 1]] = False


class SegmentOpts(Struct, forbid_unknown_fields=True):
    segment: SegName


class OwnerOpts(Struct, forbid_unknown_fields=True):
    """register_segment / unregister: the registering process's random owner token (store/node/segment.py); a live
    segment name is bound to it (master/segments.py). A named credential on the zmq control plane also names
    itself and proves it over the token (security/secret.py owner_proof), so its segments count to its name."""

    owner: Annotated[str, Meta(max_length=128)] = ""
    name: Annotated[str, Meta(max_length=64)] = ""
    proof: Annotated[bytes, Meta(max_length=32)] = b""


class DescRegion(Struct, array_like=True, forbid_unknown_fields=True, omit_defaults=True):
    """One row of a descriptor's region table: [id, length, shm_path], then [addr, [rkey per RDMA NIC]] or None,
    then the region's address in its owner (the cma transport's) or None, then 1 when it is read-only to peers,
    trailing empty items left off."""

    region_id: RegionId
    length: Size
    shm_path: Union[Annotated[str, Meta(max_length=4096)], None]
    rdma: Union[
        tuple[U64, Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 32)]], Meta(max_length=MAX_NICS)]], None
    ] = None
    addr: Union[U64, None] = None
    readonly: Union[Literal[1], None] = None


class Descriptor(Struct, forbid_unknown_fields=True):
    """kvplugins.transfer.api.SegmentDescriptor.to_wire(); ``wire()`` gives that dict back."""

    v: Literal[1]
    segment_id: SegName
    host_id: Name
    transports: Annotated[
        dict[
            Annotated[str, Meta(max_length=32)],
            Annotated[
                dict[
                    Annotated[str, Meta(max_length=64)],
                    Union[Scalar, Annotated[list[Scalar], Meta(max_length=MAX_NICS)]],
                ],
                Meta(max_length=MAX_TRANSPORT_FIELDS),
            ],
        ],
        Meta(max_length=8),
    ]
    regions: Annotated[list[DescRegion], Meta(max_length=MAX_DESC_REGIONS)]

    def wire(self) -> dict[str, object]:
        """The descriptor as SegmentDescriptor.to_wire() writes it (trailing empty items of a region row left off)."""
        out = msgspec.to_builtins(self)
        if not isinstance(out, dict):
            raise TypeError(f"a Descriptor encodes to a map, not {type(out).__name__}")
        out["regions"] = [_trimmed(r) for r in out["regions"]]
        return out


def _trimmed(row: list[object]) -> list[object]:
    """A region row without its trailing empty items (as _region_row writes it)."""
    end = len(row)
    while end > 3 and row[end - 1] is None:
        end -= 1
    return row[:end]


class TierNode(Struct, array_like=True, forbid_unknown_fields=True):
    """tier_register entry: a node's disk tier and (a chunk of) the files on it."""

    segment: SegName
    endpoint: Name
    capacity: Capacity
    files: Annotated[
        list[tuple[Annotated[str, Meta(min_length=1, max_length=MAX_FILE_KEY)], Size, U64]], Meta(max_length=MAX_FILES)
    ]  # [key, size, checksum] of each file
    disk_id: Name = ""


def bounded_list(item: object, n: int) -> object:
    """``Annotated[list[item], Meta(max_length=n)]``, built at run time: ``n`` (and ``item``'s own bounds) are
    the master's configured limits, so the type cannot be written out in the source."""
    return operator.getitem(Annotated, (types.GenericAlias(list, (item,)), Meta(max_length=n)))


def _row(*items: object) -> object:
    """``tuple[*items]``, built at run time (an item carries a configured limit: the key type)."""
    return types.GenericAlias(tuple, items)


def _op_types(key: object, batch: Callable[[object], object]) -> dict[str, tuple[object, type[Struct]]]:
    """op -> (entries type, opts type); ``key`` and ``batch(T)`` carry the configured limits."""
    keys, names = batch(key), batch(SegName)
    none = Annotated[list[None], Meta(max_length=0)]
    return {
        "info": (none, NoOpts),
        "status": (none, NoOpts),
        "put_start": (batch(_row(key, Size)), PutStartOpts),
        "put_commit": (keys, CommitOpts),
        "put_abort": (keys, NoOpts),
        "reserve": (Annotated[list[Size], Meta(max_length=64)], ReserveOpts),
        "put": (batch(_row(key, Size, U64, Offset)), CommitOpts),
        "get": (keys, GetOpts),
        "exists": (keys, NoOpts),
        "exists_prefix": (keys, NoOpts),
        "remove": (keys, NoOpts),
        "get_size": (keys, NoOpts),
        "remove_checked": (keys, RemoveCheckedOpts),
        "remove_by_regex": (
            Annotated[list[Annotated[str, Meta(max_length=MAX_PATTERN)]], Meta(min_length=1, max_length=1)],
            ForceOpts,
        ),
        "remove_all": (none, ForceOpts),
        "report_corrupt": (batch(_row(key, SegName, Offset, U64)), NoOpts),
        "register_segment": (batch(tuple[Descriptor, RegionId, Size]), OwnerOpts),
        "heartbeat": (names, NoOpts),
        "unregister": (names, OwnerOpts),
        "describe": (names, NoOpts),
        "drain": (names, NoOpts),
        "tier_poll": (names, NoOpts),
        "tier_register": (batch(TierNode), MoreOpts),
        "tier_done": (
            batch(_row(Literal["offload", "migrate", "evicted", "corrupt", "missing"], key, bool, Detail, U64)),
            SegmentOpts,
        ),
        "promote_start": (keys, SegmentOpts),
        "task_create": (
            batch(_row(Literal["copy", "move"], key, Name, Annotated[list[SegName], Meta(max_length=MAX_TARGETS)])),
            NoOpts,
        ),
        "task_query": (batch(tuple[U64, U64]), NoOpts),
        "promote_commit": (
            batch(_row(key, bool, Union[Annotated[str, Meta(max_length=MAX_DETAIL)], None])),
            SegmentOpts,
        ),
    }


def subset(opts: Struct, idx: range | list[int]) -> Struct:
    """``opts`` with its per-entry lists (``xxh3``) cut to the entries ``idx`` (indices, or a range)."""
    sums = getattr(opts, "xxh3", None)
    if sums is None:
        return opts
    return msgspec.structs.replace(
        opts, xxh3=sums[idx.start : idx.stop] if type(idx) is range else [sums[i] for i in idx]
    )


# Where each op's keys are, for the UTF-8 byte-length check msgspec cannot express (it counts characters):
# None = the entries are the keys, an int = that item of each entry; ops absent here carry no keys.
_KEY_AT = {
    "put_start": 0,
    "put": 0,
    "put_commit": None,
    "put_abort": None,
    "get": None,
    "exists": None,
    "exists_prefix": None,
    "remove": None,
    "get_size": None,
    "remove_checked": None,
    "report_corrupt": 0,
    "tier_done": 1,
    "promote_start": None,
    "promote_commit": 0,
    "task_create": 1,
}


class Limits(Protocol):
    """The MasterConfig fields the schemas are built from."""

    max_batch: int
    max_key_bytes: int


class Schemas:
    """The decoders of one master's ops under its MasterConfig limits (max_batch, max_key_bytes)."""

    def __init__(self, max_batch: int, max_key_bytes: int):
        self.max_batch, self.max_key_bytes = max_batch, max_key_bytes
        key = Annotated[str, Meta(min_length=1, max_length=max_key_bytes)]
        self.types = _op_types(key, lambda t: bounded_list(t, max_batch))
        self._envelope = msgspec.msgpack.Decoder(Envelope)
        self._decoders = {
            op: (msgspec.msgpack.Decoder(e), msgspec.msgpack.Decoder(o)) for op, (e, o) in self.types.items()
        }

    @classmethod
    def of(cls, cfg: Limits) -> "Schemas":
        return cls(cfg.max_batch, cfg.max_key_bytes)

    def decode(self, body: bytes, role: str = "admin") -> tuple[int, str, object, object]:
        """(request id, op, entries, opts) of a request body from a peer authenticated as ``role``; an op outside
        the role (security/roles.py) is refused before its entries are decoded. Raises ProtocolError for a body
        that is not a request (the connection closes), ValueError (RefusedRequest) naming the field or the
        refusal for a request this master refuses."""
        try:
            env = self._envelope.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:  # (bad UTF-8; ~1000-deep nesting)
            raise ProtocolError(f"not a request [version, id, op, entries, opts]: {e}") from e
        if env.version != VERSION:
            raise ProtocolError(f"request version {env.version!r} unsupported (this master speaks {VERSION})")
        decoders = self._decoders.get(env.op)
        if decoders is None:
            raise RefusedRequest(env.rid, f"unknown op {env.op!r}; valid: {', '.join(sorted(self._decoders))}")
        why = roles.refusal(env.op, role)
        if why is not None:
            raise RefusedRequest(env.rid, why)
        try:
            entries = decoders[0].decode(env.entries)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
            raise RefusedRequest(env.rid, f"{env.op}: entries: {self._explain(e)}") from e
        try:
            opts = decoders[1].decode(env.opts)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
            raise RefusedRequest(env.rid, f"{env.op}: opts: {e}") from e
        self._check_keys(env.rid, env.op, entries)
        return env.rid, env.op, entries, opts

    def convert(self, op: str, entries: Iterable[object], opts: dict[str, object]) -> tuple[object, object]:
        """The typed (entries, opts) of Python values (in-process callers). Raises ValueError naming the field."""
        types = self.types.get(op)
        if types is None:
            raise ValueError(f"unknown op {op!r}; valid: {', '.join(sorted(self.types))}")
        try:
            entries = msgspec.convert(list(entries), types[0])
        except msgspec.ValidationError as e:
            raise ValueError(f"{op}: entries: {self._explain(e)}") from e
        try:
            opts = msgspec.convert(opts, types[1])
        except msgspec.ValidationError as e:
            raise ValueError(f"{op}: opts: {e}") from e
        self._check_keys(0, op, entries)
        return entries, opts

    def _explain(self, err: Exception) -> str:
        text = str(err)
        if "length <=" in text and f"<= {self.max_batch}" in text:
            text += f" (the master's max_batch is {self.max_batch}: split the batch or raise master.max_batch)"
        elif f"length <= {self.max_key_bytes}" in text:
            text += f" (keys are at most master.max_key_bytes={self.max_key_bytes} bytes)"
        return text

    def _check_keys(self, rid: int, op: str, entries: object) -> None:
        """Keys within max_key_bytes UTF-8 bytes (msgspec bounded their characters already)."""
        if op not in _KEY_AT or not isinstance(entries, list) or not entries:
            return
        at, quarter = _KEY_AT[op], self.max_key_bytes // 4
        keys = entries if at is None else list(map(operator.itemgetter(at), entries))
        try:
            if max(map(len, keys)) <= quarter:  # at most 4 UTF-8 bytes a character: no key is too long (C speed)
                return
        except TypeError:  # an entry without a length there: checked one by one below
            pass
        for j, k in enumerate(keys):
            if isinstance(k, str) and len(k) > quarter and len(k.encode()) > self.max_key_bytes:
                raise RefusedRequest(
                    rid,
                    f"{op}: entries: key of {len(k.encode())} UTF-8 bytes is longer than "
                    f"master.max_key_bytes={self.max_key_bytes} - at `$[{j}]`",
                )


class RefusedRequest(ValueError):
    """A well-formed request this master refuses (unknown op, an invalid field): answered, connection kept."""

    def __init__(self, rid: int, reason: str):
        super().__init__(reason)
        self.rid = rid
