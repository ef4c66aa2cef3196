"""Administrative master ops that inspect or walk the object table: ``get_size``, ``remove_checked``,
``remove_by_regex``, ``remove_all`` (what the Mooncake-compatible client, kvplugins/mooncake/api.py, needs beyond
the batch ops).

Mooncake semantics: without ``{"force": true}`` in opts these removes skip objects whose read lease is still
running (a plain ``remove`` op does not: it removes at once and frees the space when the lease ends; both keep
a reader's leased bytes valid). ``remove_by_regex`` and ``remove_all`` scan every object: they run as a ``Scan`` the RPC server advances
one slice at a time between its other events (issue #11): at most SCAN_SLICE objects and SLICE_BUDGET_S of the
master's thread, so other clients' ops wait at most one slice. The patterns run on RE2 (``google-re2``: linear
time in the key length, no backtracking), never on Python's ``re``; a pattern whose compiled program exceeds
MAX_PROGRAM instructions is refused, since RE2 runs those in its slow NFA (issue #30: ``(ab|ba){1000}zz`` cost
0.2 s per 4 KiB key; at MAX_PROGRAM a key costs about 5 ms). Removal goes through
``MasterService.op_remove``. Follows Mooncake 0.3.13's Remove/RemoveByRegex/RemoveAll/GetSize master operations
(semantics, observed against a real mooncake_master; not code).
"""

from __future__ import annotations

import time

import re2

from kvplugins.store.master.batches import SLICE_BUDGET_S, Deferred
from kvplugins.store.wire.protocol import INVALID, NOT_FOUND, OK

SCAN_SLICE = 4096  # objects one step of a Scan examines at most (a few ms of the master's thread),
# ending at the first key past SLICE_BUDGET_S
MAX_PROGRAM = 2000  # RE2 program instructions a remove_by_regex pattern may compile to


class Scan(Deferred):
    """An admin op over every object, advanced in slices by whoever serves it: ``step(now)`` examines up to
    SCAN_SLICE objects of the snapshot taken at the start and returns True once done; ``result`` is then the op's
    payload ``[OK, removed count]``. Objects removed or replaced since the snapshot are skipped."""

    def __init__(self, service, force: bool, match):
        self.service, self.force, self.match = service, force, match
        self._objs = service.table.lru()
        self._at, self.removed, self.result = 0, 0, None

    def step(self, now: float) -> bool:
        force, match, objs, keys = self.force, self.match, self._objs, []
        end, until = min(len(objs), self._at + SCAN_SLICE), time.perf_counter() + SLICE_BUDGET_S
        while self._at < end:
            o = objs[self._at]
            self._at += 1
            if o.alive() and o.complete and (force or not o.leased(now)) and match(o.key):
                keys.append(o.key)
            if time.perf_counter() > until:
                break
        self.removed += _remove(self.service, keys, now)
        if self._at < len(self._objs):
            return False
        self._objs, self.result = [], [OK, self.removed]
        return True


def ops(service) -> dict:
    """name -> fn(entries, opts, now) for MasterService's dispatcher (entries/opts as kvplugins.store.wire.schema)."""
    return {
        "get_size": lambda entries, opts, now: get_size(service, entries),
        "remove_checked": lambda entries, opts, now: remove_checked(service, entries, opts.force, now, opts.segment),
        "remove_by_regex": lambda entries, opts, now: remove_by_regex(service, entries[0], opts.force),
        "remove_all": lambda entries, opts, now: Scan(service, opts.force, lambda key: True),
    }


def get_size(service, keys: list) -> list:
    """Per key ``[OK, size in bytes]`` for a complete object, else ``[NOT_FOUND, None]``."""
    out = []
    for key in keys:
        obj = service.table.get(key)
        out.append([OK, obj.size] if obj is not None and obj.complete else [NOT_FOUND, None])
    return out


def remove_checked(service, keys: list, force: bool, now: float, segment: str = "") -> list:
    """Per key "removed", "missing" (no complete object) or "leased" (a read lease runs and not ``force``).
    With ``segment``, only the object's replicas on that segment go (MasterService.clear_replicas): "cleared"
    when other replicas remain, "removed" when none does, "elsewhere" when it has none there."""
    out = []
    for key in keys:
        obj = service.table.get(key)
        if obj is None or not obj.complete:
            out.append("missing")
        elif obj.leased(now) and not force:
            out.append("leased")
        elif segment:
            out.append(service.clear_replicas(obj, segment, now))
        else:
            out.append("removed" if _remove(service, [key], now) else "missing")
    return out


def remove_by_regex(service, pattern: str, force: bool):
    """A Scan removing the objects whose key matches ``pattern`` (RE2 syntax, searched anywhere in the key, as
    ``re.search``; RE2 has no backreferences or lookaround), or ``[INVALID, reason]`` for a pattern RE2
    refuses or one compiling to more than MAX_PROGRAM instructions."""
    options = re2.Options()
    options.log_errors = False  # the reason goes back to the caller, not to the master's stderr
    try:
        regex = re2.compile(pattern, options)
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        return [INVALID, f"regex {pattern!r} does not compile under RE2 (no backreferences or lookaround): {why}"]
    if regex.programsize > MAX_PROGRAM:
        return [
            INVALID,
            f"regex {pattern!r:.80} compiles to {regex.programsize} RE2 instructions, over the "
            f"master's limit of {MAX_PROGRAM} (its matching would stall the master); use a shorter "
            "pattern, e.g. fewer or smaller counted repetitions",
        ]
    return Scan(service, force, regex.search)


def _remove(service, keys: list[str], now: float) -> int:
    return sum(1 for code, _ in service.op_remove(keys, None, now) if code == OK)
