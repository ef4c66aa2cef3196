"""Ops that run in slices between other clients' requests (issue #30 item 3: no client waits on another's batch).

A ``Deferred`` op is advanced by whoever serves it (rpc_server.py): ``step(now)`` does up to one slice and returns
True once ``result`` is the op's payload; in-process callers ``run`` it to the end at once. Two kinds:
admin_ops.Scan (remove_by_regex, remove_all over the whole table) and ``Sliced``: a data op whose batch has
more than SLICE_KEYS entries (put_start, put_commit, put_abort, put, get, exists, remove, get_size) runs
SLICE_KEYS entries at a time, as many as fit in SLICE_BUDGET_S per step, and its answers are joined into the
one payload the whole batch would have had (per-entry lists; a get's column answer re-indexed). Entries are
independent in every sliced op, so the answers are those of the unsliced op, except that other clients' ops
may land between slices (as they could between two batches).
"""

from __future__ import annotations

import time

from kvplugins.store.wire.schema import subset

SLICED = frozenset({"put_start", "put_commit", "put_abort", "put", "get", "exists", "remove", "get_size"})
SLICE_KEYS = 512  # entries per slice: ~5 ms of put_start on the slowest path (15 us a key)
SLICE_BUDGET_S = 0.01  # a step runs slices until this much time has passed


class Deferred:
    """An op run in slices: ``step(now)`` -> done; ``result`` is its payload once done."""

    result = None
    waiting = False  # True while a step would do nothing (it waits on another thread: admission.Admission)

    def step(self, now: float) -> bool:
        raise NotImplementedError

    def run(self, now: float):
        """Run to the end at once (in-process callers); returns the payload."""
        while not self.step(now):
            pass
        return self.result


class Sliced(Deferred):
    """Batch op ``op`` over ``entries`` run SLICE_KEYS entries at a time by ``run(op, entries, opts, now)``."""

    def __init__(self, run, op: str, entries: list, opts):
        """Raises ValueError for per-entry options that do not match the entries (nothing is applied then)."""
        sums = getattr(opts, "xxh3", None)
        if sums is not None and len(sums) != len(entries):
            raise ValueError(f"{op}: opts: xxh3 has {len(sums)} checksums for {len(entries)} keys")
        self._run, self.op, self._entries, self._opts = run, op, entries, opts
        self._at, self._parts = 0, []

    def step(self, now: float) -> bool:
        until = time.perf_counter() + SLICE_BUDGET_S
        entries = self._entries
        while self._at < len(entries):
            end = min(len(entries), self._at + SLICE_KEYS)
            opts = subset(self._opts, range(self._at, end))
            self._parts.append((self._at, self._run(self.op, entries[self._at : end], opts, now)))
            self._at = end
            if time.perf_counter() > until:
                break
        if self._at < len(entries):
            return False
        cols = self.op == "get" and getattr(self._opts, "cols", 0)
        self.result = join_cols(self._parts) if cols else [a for _, part in self._parts for a in part]
        self._parts, self._entries = [], []
        return True


def join_cols(parts: list) -> list:
    """One get column answer (service.op_get with cols) from [(first entry index, column answer)] of slices."""
    ttl = parts[0][1][0]
    sizes, names, regions, seg_idx, offs, more, sums, disk = [], [], [], [], [], {}, [], {}
    index: dict[str, int] = {}
    for at, (_, p_sizes, p_names, p_regions, p_idx, p_offs, p_more, p_sums, p_disk) in parts:
        remap = []
        for name, region in zip(p_names, p_regions):
            if name not in index:
                index[name] = len(names)
                names.append(name)
                regions.append(region)
            remap.append(index[name])
        sizes += p_sizes
        seg_idx += [remap[k] if k >= 0 else k for k in p_idx]
        offs += p_offs
        sums += p_sums
        more.update({at + j: v for j, v in p_more.items()})
        disk.update({at + j: v for j, v in p_disk.items()})
    return [ttl, sizes, names, regions, seg_idx, offs, more, sums, disk]
