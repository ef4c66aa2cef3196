"""Mooncake 0.3.13's put and get sessions, a mixin of api.MooncakeDistributedStore (over StoreClient's
put_start / locate / transfer_ranges).

A put session: ``batch_put_session_start`` reserves objects (0, or OBJECT_ALREADY_EXISTS -705 for a stored key),
``batch_put_from_multi_buffer_ranges`` writes byte ranges of them from registered buffers at offsets the caller
picks (bytes written per key), ``batch_put_session_end`` makes them readable, ``batch_put_session_revoke``
drops them. A get session: ``batch_get_session_start`` looks objects up once (0 or OBJECT_NOT_FOUND),
``batch_get_into_multi_buffer_ranges`` reads byte ranges of them, ``batch_get_session_end`` forgets them. A key
with no session, or a range past the object's end, answers INVALID_PARAMS: each code as a real mooncake_master
answered it (tests/store/test_mooncake_api.py). A session's objects are committed without a checksum (no one holds
the whole object); a get session whose lease ran out looks its object up again before reading, and a read that
ends after the lease is read again under a new one (StoreClient.transfer_ranges), never stale bytes.
"""

from __future__ import annotations

import threading
import time

from kvplugins.store.wire import protocol
from kvplugins.mooncake.codes import INVALID_PARAMS, OK, guard, per_key, code_of, pybind
from kvplugins.mooncake.checks import DEFAULT, ReplicateConfig

OBJECT_ALREADY_EXISTS = -705


class SessionMethods:
    """Mixed into MooncakeDistributedStore (``_c``, ``_put_cfg``); session state lives per store object."""

    def _sessions(self):
        if not hasattr(self, "_session_state"):
            self._session_state = ({}, {}, threading.Lock())  # put: key -> (locations, size); get: key -> ...
        return self._session_state

    @pybind
    @guard(on_error=per_key)
    def batch_put_session_start(
        self, keys: list[str], sizes: list[int], config: ReplicateConfig = DEFAULT
    ) -> list[int]:
        puts, _, lock = self._sessions()
        cfg = self._put_cfg(config)
        out = []
        for key, size, (code, value) in zip(keys, sizes, self._c.put_start(keys, sizes, cfg)):
            if code == protocol.OK:
                with lock:
                    puts[key] = (value, int(size))
                out.append(OK)
            else:
                out.append(
                    OBJECT_ALREADY_EXISTS
                    if code == protocol.EXISTS
                    else code_of(protocol.entry_error(code, key, value))
                )
        return out

    @pybind
    @guard(on_error=per_key)
    def batch_put_from_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_dst_offsets: list[list[int]],
    ) -> list[int]:
        puts, _, lock = self._sessions()
        with lock:
            known = [puts.get(k) for k in keys]
        return self._ranges("write", keys, known, all_buffer_ptrs, all_sizes, all_dst_offsets)

    @pybind
    @guard(on_error=per_key)
    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        return self._finish(keys, self._c.put_commit)

    @pybind
    @guard(on_error=per_key)
    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        return self._finish(keys, self._c.put_abort)

    @pybind
    @guard(on_error=per_key)
    def batch_get_session_start(self, keys: list[str]) -> list[int]:
        _, gets, lock = self._sessions()
        out, now = [], time.monotonic()
        for key, (code, value) in zip(keys, self._c.locate(keys)):
            if code == protocol.OK:
                with lock:
                    gets[key] = (value.replicas, value.size, now + value.lease_ttl_ms / 1000)
                out.append(OK)
            else:
                out.append(code_of(protocol.entry_error(code, key, value)))
        return out

    @pybind
    @guard(on_error=per_key)
    def batch_get_into_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_src_offsets: list[list[int]],
    ) -> list[int]:
        _, gets, lock = self._sessions()
        with lock:
            known = [gets.get(k) for k in keys]
        stale = [k for k, s in zip(keys, known) if s is not None and time.monotonic() > s[2]]
        if stale:  # the lease ran out: look them up again
            self.batch_get_session_start(stale)
            with lock:
                known = [gets.get(k) for k in keys]
        lease_end = min((s[2] for s in known if s is not None), default=None)
        return self._ranges(
            "read",
            keys,
            [None if s is None else s[:2] for s in known],
            all_buffer_ptrs,
            all_sizes,
            all_src_offsets,
            lease_end,
        )

    @pybind
    @guard()
    def batch_get_session_end(self, keys: list[str]) -> int:
        _, gets, lock = self._sessions()
        with lock:
            for key in keys:
                gets.pop(key, None)
        return OK

    def _finish(self, keys: list[str], rpc) -> list[int]:
        puts, _, lock = self._sessions()
        with lock:
            mine = [k for k in keys if puts.pop(k, None) is not None]
        codes = dict(zip(mine, (c for c, _ in rpc(mine))))
        return [
            INVALID_PARAMS
            if k not in codes
            else OK
            if codes[k] == protocol.OK
            else code_of(protocol.entry_error(codes[k], k, "session expired"))
            for k in keys
        ]

    def _ranges(self, kind: str, keys, known, ptrs, sizes, offsets, lease_end: float | None = None) -> list[int]:
        """Per key the bytes moved, or INVALID_PARAMS (no session, lists that do not line up, a range past the
        object's end), or the transfer's code. ``lease_end``: as StoreClient.transfer_ranges (reads ending
        after the session's lease are looked up and read again)."""
        out, locations = [INVALID_PARAMS] * len(keys), {}
        spans, offs = [[] for _ in keys], [[] for _ in keys]
        for i, (session, p, n, o) in enumerate(zip(known, ptrs, sizes, offsets)):
            if session is None or not len(p) == len(n) == len(o):
                continue
            locs, size = session
            if all(off + m <= size for off, m in zip(o, n)):
                locations[i], spans[i], offs[i], out[i] = locs, list(zip(p, n)), list(o), sum(n)
        errs = self._c.transfer_ranges(kind, list(keys), spans, offs, locations, lease_end)
        return [code_of(e) if e is not None and i in locations else out[i] for i, e in enumerate(errs)]
