"""Turning (key, spans) plus master locations into transfer-core requests (gather on put, scatter on get).

A location is ``[segment name, region id, offset]``; the object's bytes are the concatenation of the spans, so
span j lands at ``offset + sum(len of spans before j)`` of every replica. A read uses the replica(s) it is given
(client.py tries them in order).
"""
from __future__ import annotations

from kvplugins.errors import BufferNotRegistered, StoreError, TransferFailed


def local_spans(engine, keys, spans_per_key, out) -> list:
    """Per key: [(Region, offset in region, nbytes)], resolving each span's registered region.
    Sets ``out[i]`` to BufferNotRegistered for keys whose spans are not in registered memory."""
    if len(keys) != len(spans_per_key):
        raise StoreError(f"{len(keys)} keys but {len(spans_per_key)} span lists; pass one span list per key")
    resolved = []
    for i, spans in enumerate(spans_per_key):
        resolved.append([])
        if out[i] is not None:
            continue
        try:
            for addr, n in spans:
                if n > 0:
                    region = engine.region_for(int(addr), int(n))
                    resolved[i].append((region, int(addr) - region.addr, int(n)))
        except BufferNotRegistered as e:
            out[i] = BufferNotRegistered(f"{keys[i]}: {e}; call register_buffer on that memory first")
    return resolved


def reject_empty(keys, spans_per_key, out) -> None:
    """A put needs at least one byte: set ``out[i]`` for keys whose spans are empty."""
    for i, spans in enumerate(spans_per_key):
        if out[i] is None and not any(n > 0 for _, n in spans):
            out[i] = StoreError(f"{keys[i]}: empty object; spans must hold at least 1 byte")


def _requests(i, locs, spans, descs, failed, reqs, owner) -> None:
    from kvplugins.transfer import TransferRequest
    for seg, region_id, offset in locs:
        desc = descs.get(seg)
        if desc is None:
            failed[i] = TransferFailed(f"segment {seg} is gone (node died or unregistered)")
            return
        pos = offset
        for region, local_off, n in spans:
            reqs.append(TransferRequest(region, local_off, desc, int(region_id), pos, n))
            owner.append(i)
            pos += n


def write_requests(todo: dict, locals_, descs, failed):
    """Requests writing every key's spans to every replica. Returns (requests, owning key index per request)."""
    reqs, owner = [], []
    for i, locs in todo.items():
        _requests(i, locs, locals_[i], descs, failed, reqs, owner)
    return reqs, owner


def read_requests(todo: dict, locals_, descs, failed):
    """Requests reading every key from the first of its locations into its spans. ``todo[i]`` = [size, locs, ttl]."""
    reqs, owner = [], []
    for i, (_, locs, _) in todo.items():
        _requests(i, locs[:1], locals_[i], descs, failed, reqs, owner)
    return reqs, owner
