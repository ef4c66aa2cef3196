"""Administrative master ops that walk or inspect the object table: ``get_size``, ``remove_by_regex``,
``remove_all`` (what the Mooncake-compatible client, kvplugins/store/compat.py, needs beyond the batch ops).

``remove_by_regex`` and ``remove_all`` scan every object in the master's single thread: O(objects), so they
are for operators and tests, never for the per-request path. Removal goes through ``MasterService.op_remove``,
so leases are honoured exactly as for a plain remove (a reader's leased bytes stay valid until the lease ends).
Follows Mooncake 0.3.13's RemoveByRegex/RemoveAll/GetSize master operations (semantics, not code).
"""
from __future__ import annotations

import re

from kvplugins.store.protocol import INVALID, NOT_FOUND, OK


def ops(service) -> dict:
    """name -> fn(entries, opts, now) for MasterService's dispatcher."""
    return {
        "get_size": lambda entries, opts, now: get_size(service, entries),
        "remove_by_regex": lambda entries, opts, now: remove_by_regex(service, entries, now),
        "remove_all": lambda entries, opts, now: remove_all(service, now),
    }


def get_size(service, keys: list) -> list:
    """Per key ``[OK, size in bytes]`` for a complete object, else ``[NOT_FOUND, None]``."""
    out = []
    for key in keys:
        obj = service.table.get(key) if isinstance(key, str) else None
        out.append([OK, obj.size] if obj is not None and obj.complete else [NOT_FOUND, None])
    return out


def remove_by_regex(service, entries: list, now: float) -> list:
    """entries: ``[pattern]`` (Python ``re`` syntax, matched with ``re.search``). Answers ``[OK, removed count]``
    or ``[INVALID, reason]`` for a pattern that does not compile."""
    if len(entries) != 1 or not isinstance(entries[0], str):
        return [INVALID, f"remove_by_regex takes exactly one pattern string, got {entries!r:.80}"]
    try:
        pattern = re.compile(entries[0])
    except re.error as e:
        return [INVALID, f"regex {entries[0]!r} does not compile: {e}"]
    keys = [o.key for o in service.table.iter_lru() if o.complete and pattern.search(o.key)]
    return [OK, _remove(service, keys, now)]


def remove_all(service, now: float) -> list:
    """Remove every complete object; answers ``[OK, removed count]``."""
    return [OK, _remove(service, [o.key for o in service.table.iter_lru() if o.complete], now)]


def _remove(service, keys: list[str], now: float) -> int:
    return sum(1 for code, _ in service.op_remove(keys, {}, now) if code == OK)

