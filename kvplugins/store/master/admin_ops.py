"""Administrative master ops that inspect or walk the object table: ``get_size``, ``remove_checked``,
``remove_by_regex``, ``remove_all`` (what the Mooncake-compatible client, kvplugins/store/compat.py, needs beyond
the batch ops).

Mooncake semantics: without ``{"force": true}`` in opts these removes skip objects whose read lease is still
running (a plain ``remove`` op does not: it removes at once and frees the space when the lease ends; both keep
a reader's leased bytes valid). ``remove_by_regex`` and ``remove_all`` scan every object in the master's single
thread: O(objects), so they are for operators and tests, never for the per-request path. Removal goes through
``MasterService.op_remove``. Follows Mooncake 0.3.13's Remove/RemoveByRegex/RemoveAll/GetSize master operations
(semantics, observed against a real mooncake_master; not code).
"""
from __future__ import annotations

import re

from kvplugins.store.protocol import INVALID, NOT_FOUND, OK


def ops(service) -> dict:
    """name -> fn(entries, opts, now) for MasterService's dispatcher."""
    return {
        "get_size": lambda entries, opts, now: get_size(service, entries),
        "remove_checked": lambda entries, opts, now: remove_checked(service, entries, bool(opts.get("force")), now),
        "remove_by_regex": lambda entries, opts, now: remove_by_regex(service, entries, bool(opts.get("force")),
                                                                      now),
        "remove_all": lambda entries, opts, now: remove_all(service, bool(opts.get("force")), now),
    }


def get_size(service, keys: list) -> list:
    """Per key ``[OK, size in bytes]`` for a complete object, else ``[NOT_FOUND, None]``."""
    out = []
    for key in keys:
        obj = service.table.get(key) if isinstance(key, str) else None
        out.append([OK, obj.size] if obj is not None and obj.complete else [NOT_FOUND, None])
    return out


def remove_checked(service, keys: list, force: bool, now: float) -> list:
    """Per key "removed", "missing" (no complete object) or "leased" (a read lease runs and not ``force``)."""
    out = []
    for key in keys:
        obj = service.table.get(key) if isinstance(key, str) else None
        if obj is None or not obj.complete:
            out.append("missing")
        elif obj.leased(now) and not force:
            out.append("leased")
        else:
            out.append("removed" if _remove(service, [key], now) else "missing")
    return out


def remove_by_regex(service, entries: list, force: bool, now: float) -> list:
    """entries: ``[pattern]`` (Python ``re`` syntax, matched with ``re.search``). Answers ``[OK, removed count]``
    or ``[INVALID, reason]`` for a pattern that does not compile."""
    if len(entries) != 1 or not isinstance(entries[0], str):
        return [INVALID, f"remove_by_regex takes exactly one pattern string, got {entries!r:.80}"]
    try:
        pattern = re.compile(entries[0])
    except re.error as e:
        return [INVALID, f"regex {entries[0]!r} does not compile: {e}"]
    return [OK, _remove(service, _removable(service, force, now, pattern.search), now)]


def remove_all(service, force: bool, now: float) -> list:
    """Remove every complete object (not leased ones unless ``force``); answers ``[OK, removed count]``."""
    return [OK, _remove(service, _removable(service, force, now, lambda key: True), now)]


def _removable(service, force: bool, now: float, match) -> list[str]:
    """Keys of every complete object (unpinned, pinned and disk-only alike) that ``match`` and may go now."""
    return [o.key for o in service.table.lru() if o.complete and (force or not o.leased(now)) and match(o.key)]


def _remove(service, keys: list[str], now: float) -> int:
    return sum(1 for code, _ in service.op_remove(keys, {}, now) if code == OK)
