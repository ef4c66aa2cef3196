"""Byte ranges of objects at known locations: the store side of Mooncake's put and get *sessions*
(sessions.py). A put session reserves objects (``put_start``: pending, allocated), writes ranges of them
at offsets the caller picks, then commits (``put_commit``, no checksum: the client never holds the whole object)
or aborts them; a get session looks objects up once (``get``, with a lease) and reads ranges of them.

Functions over a StoreClient (its RPC and transfer engine), like client_io.py; every transfer is one array-form
batch per (segment, region), as the client's own puts and gets.
"""
from __future__ import annotations

import numpy as np

from kvplugins.errors import StoreError
from kvplugins.store import client_io


def reserve(client, keys: list[str], sizes: list[int], config=None) -> list:
    """put_start: per key [code, locations or why] (protocol codes; EXISTS for a stored key)."""
    cfg = config or client._put_cfg
    return client._rpc_entries("put_start", [[k, int(n)] for k, n in zip(keys, sizes)], cfg.wire)


def commit(client, keys: list[str]) -> list:
    """put_commit without checksums: per key [code, detail]."""
    return client._rpc_entries("put_commit", list(keys), {"xxh3": [None] * len(keys)})


def abort(client, keys: list[str]) -> list:
    return client._rpc_entries("put_abort", list(keys))


def locate(client, keys: list[str]) -> list:
    """get: per key [code, [size, locations, lease ttl ms, checksum]] (disk-only objects promoted first)."""
    return client._lookup(list(keys))


def transfer_at(client, kind: str, keys: list[str], spans: list[list[tuple[int, int]]], offsets: list[list[int]],
                locations: dict[int, list]) -> list[StoreError | None]:
    """Write (``kind`` "write") or read each key's spans (address, bytes) at the given offsets inside the object,
    at ``locations[i]`` (every replica for a write, the first for a read). Per key None or the error (a span
    outside registered memory: BufferNotRegistered)."""
    out: list[StoreError | None] = [None] * len(keys)
    flat = client_io.arrays(client_io.flatten(client._engine, keys, spans, out))
    flat.inner = np.fromiter((o for offs in offsets for o in offs), dtype=np.uint64, count=len(flat.lens))
    todo = {i: locs if kind == "write" else locs[:1] for i, locs in locations.items() if out[i] is None}
    failed: dict[int, StoreError] = {}
    descs = client._descriptors({loc[0] for locs in todo.values() for loc in locs})
    client._run_groups(kind, flat, client_io.groups(flat, todo, descs, failed), failed, None)
    for i, err in failed.items():
        out[i] = err
    return out
