"""The store's replies as typed structs: what the client reads out of a master's per-entry answers.

Every batch op answers one ``[code, value]`` entry per key (store/wire/protocol.py codes). The values the
client acts on are decoded here, once, into frozen msgspec structs: a ``get``/``locate`` hit is a ``Found``, a
``put_start`` grant a list of ``Location`` (one per replica), a ``get_size`` answer one size per key, a
removing scan's answer its count. On the wire they stay msgpack arrays (the
structs are ``array_like``), so nothing changes for the master or another client version. ``found`` and
``locations`` raise StoreError naming what is malformed: nothing a master says is trusted as a size or an
offset without this check (a negative or oversized number fails here, not inside a transfer).
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from kvplugins.errors import StoreError
from kvplugins.store.wire.protocol import OK
from kvplugins.store.wire.schema import U64, RegionId, SegName

__all__ = ["Found", "Location", "found", "locations", "sizes", "count", "outcomes"]

Bytes63 = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]  # a size or offset in bytes (no memory is 2**63)


class Location(Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One replica's place: ``offset`` bytes into exported region ``region`` of segment ``segment``."""

    segment: SegName
    region: RegionId
    offset: Bytes63


class Found(Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A stored object, as a get answers it: ``size`` bytes, its ``replicas`` (read the first, fall back in
    order), the read lease the get took (``lease_ttl_ms``: no eviction or reallocation within it) and the
    object's xxh3_64 ``checksum`` (None: stored without one)."""

    size: Bytes63
    replicas: Annotated[list[Location], Meta(min_length=1, max_length=64)]  # PutStartOpts.replicas <= 64
    lease_ttl_ms: Bytes63
    checksum: Union[U64, None] = None


def found(value: object) -> Found:
    """The Found of a get entry's value (a Found passes as is). Raises StoreError."""
    if isinstance(value, Found):
        return value
    try:
        return msgspec.convert(value, Found)
    except msgspec.ValidationError as e:
        raise StoreError(f"malformed get answer from the master: {e} (value {value!r:.120})") from e


def locations(value: object) -> list[Location]:
    """The replica Locations of a put_start grant. Raises StoreError."""
    try:
        return msgspec.convert(value, list[Location])
    except msgspec.ValidationError as e:
        raise StoreError(f"malformed put_start answer from the master: {e} (value {value!r:.120})") from e


def sizes(value: object) -> list[int | None]:
    """Per key of a ``get_size`` answer (``[OK, size]`` or ``[NOT_FOUND, None]`` entries): the object's size in
    bytes, or None where it is not stored complete. Raises StoreError."""
    try:
        entries = msgspec.convert(value, list[tuple[int, Union[Bytes63, None]]])
    except msgspec.ValidationError as e:
        raise StoreError(f"malformed get_size answer from the master: {e} (value {value!r:.120})") from e
    return [size if code == OK else None for code, size in entries]


def count(value: object, op: str) -> int:
    """The number of objects a removing scan (``remove_by_regex``, ``remove_all``) answered as ``[OK, count]``.
    Raises ValueError with the master's reason for ``[INVALID, reason]`` (a pattern RE2 refuses), StoreError for
    anything else."""
    try:
        code, detail = msgspec.convert(value, tuple[int, Union[Bytes63, str]])
    except msgspec.ValidationError as e:
        raise StoreError(f"malformed {op} answer from the master: {e} (value {value!r:.120})") from e
    if code != OK or not isinstance(detail, int):
        raise ValueError(f"{op}: {detail}")
    return detail


def outcomes(value: object, op: str) -> list[str]:
    """Per key of a ``remove_checked`` answer: its outcome word ("removed", "missing", "leased"; with a segment
    also "cleared", "elsewhere": store/master/admin_ops.py). Raises StoreError."""
    try:
        return msgspec.convert(value, list[str])
    except msgspec.ValidationError as e:
        raise StoreError(f"malformed {op} answer from the master: {e} (value {value!r:.120})") from e
