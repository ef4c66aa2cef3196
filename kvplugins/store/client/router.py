"""ShardedRpc: the master client of a sharded store (``shards://host:port/prefix``), with the interface of
RawRpcClient (call / send_deferred / flush / close, ``address``, ``timeout_ms``), so StoreClient and the
Mooncake layer run on it unchanged.

Each batch op is split by the ring (cluster.py): one request per shard, sent in parallel, answers merged back
in the caller's order. A shard is dialled at its member address with master_client (a single master, or an HA
pair it follows across fail-overs). While a move is on (ClusterState.moving):
- reads (get, exists, get_size) that miss on the new owner ask the previous owner (dual lookup);
- removes go to both owners;
- a put first asks the previous owner whether the key is stored (then it is a no-op, as on one master).
The reads ``exists`` (and ``exists_prefix``), ``get`` and ``get_size`` without options, while no move is on (each
shard a single master or an HA pair: its leader's connection; an HA shard whose leader does not answer sends the
whole batch the Python way, which retries on the next leader), run as ONE native call (native.shard_exists /
shard_call: hashing, one request per shard on its connection, the replies read in one poll loop, GIL released;
exists merged natively, the others' replies decoded here and merged by each key's shard); the rest below is the same
for them. A shard that does not answer costs only its own keys: reads of them are misses, writes fail with
UNAVAILABLE (MasterUnreachable when no shard answered at all). WRONG_SHARD answers make it re-read the membership
and resend those entries, after a pause that doubles from RESEND_FIRST_S up to POLL_S, until the op's timeout: the
stale view may be the master's (it reads the membership every 0.5 s too). (Before, during a move the resends were
never sent, the entries still holding their first answer, and 54 of ~14,000 puts failed while a shard joined and
left.) A watcher thread re-reads the membership every POLL_S.
"""

from __future__ import annotations

import contextlib
import logging
import reprlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvplugins import native
from kvplugins.errors import MasterUnreachable, ProtocolError, StoreError
from kvplugins.store.client.follower import LeaderClient
from kvplugins.store.client.rpc import RawRpcClient
from kvplugins.store.wire.protocol import EXISTS, NOT_FOUND, OK, UNAVAILABLE, WRONG_SHARD
from kvplugins.store.cluster.membership import ClusterState, Membership

log = logging.getLogger(__name__)
POLL_S = 0.5
RESEND_FIRST_S = 0.05  # WRONG_SHARD: the first pause before a resend, doubling up to POLL_S (module doc)
KEYED = frozenset(
    {
        "get",
        "exists",
        "put_start",
        "put_commit",
        "put_abort",
        "remove",
        "report_corrupt",
        "put",
        "get_size",
        "remove_checked",
    }
)
READS = frozenset({"get", "exists", "get_size"})
NATIVE_READS = READS  # one native fan-out while no move is on (module doc)
REMOVES = frozenset({"remove", "remove_checked"})
PUTS = frozenset({"put_start", "put"})
STR_KEYED = frozenset({"get", "exists", "put_commit", "put_abort", "remove", "get_size", "remove_checked"})
SUMMED = frozenset({"remove_all", "remove_by_regex"})  # payload [code, count] per shard


class ShardedRpc:
    """Routes master ops over the shards of the store at ``address`` (shards://...). Raises MasterUnreachable
    if the membership cannot be read within ``timeout_ms``, StoreError if the store has no shard yet.
    ``connect``: (a shard's address, timeout ms, role) -> its client (store/client/connect.py master_client)."""

    def __init__(self, address: str, timeout_ms: float, role: str, *, connect):
        self.address, self.timeout_ms, self.role = address, timeout_ms, role
        self._connect = connect
        self._members = Membership(address, timeout_s=min(2.0, timeout_ms / 1000))
        self.state = self._first_read()
        self._clients: dict[str, object] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvp-shard-rpc")
        self._fresh = threading.Event()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvp-shard-ring", daemon=True)
        self._thread.start()

    # ---- the RawRpcClient interface ----------------------------------------------------------------------
    def call(self, op: str, entries=(), opts: dict | None = None, timeout_ms: float | None = None):
        entries, opts = list(entries), opts or {}
        if op in KEYED:
            return self._keyed(op, entries, opts, timeout_ms)
        if op == "exists_prefix":
            found = self._keyed("exists", entries, {}, timeout_ms)
            return next((i for i, ok in enumerate(found) if not ok), len(found))
        answers = self._fan(op, entries, opts, timeout_ms, self.state.members)
        good = {sid: a for sid, a in answers.items() if not isinstance(a, StoreError)}
        if not good:
            raise next(iter(answers.values()), StoreError(f"{self.address}: the store has no shard"))
        if op == "describe":
            return [
                next((a[j] for a in good.values() if a[j][0] == OK), [NOT_FOUND, None]) for j in range(len(entries))
            ]
        if op in SUMMED:
            return [OK, sum(a[1] for a in good.values() if a[0] == OK)]
        if op == "status":
            return {"shards": good, "unreachable": {s: str(a) for s, a in answers.items() if s not in good}}
        return next(iter(good.values()))  # info and the like: any shard's answer

    def send_deferred(self, op: str, entries=(), opts: dict | None = None, on_reply=None) -> None:
        """A pipelined op (put_commit), sent now per shard; ``on_reply(True, per-entry answers)`` once every
        shard answered (a failed shard's entries answer UNAVAILABLE)."""
        entries, opts = list(entries), opts or {}
        parts = self.state.ring.split([_key(e) for e in entries])
        out: list = [None] * len(entries)
        left = [len(parts)]
        lock = threading.Lock()

        def done(idx, ok, payload, sid):
            for j, i in enumerate(idx):
                out[i] = payload[j] if ok and isinstance(payload, list) else [UNAVAILABLE, f"shard {sid}: {payload}"]
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last and on_reply is not None:
                on_reply(True, out)

        for sid, idx in parts.items():
            try:
                self._client(sid).send_deferred(
                    op,
                    [entries[i] for i in idx],
                    _subset(opts, idx),
                    on_reply=lambda ok, p, idx=idx, sid=sid: done(idx, ok, p, sid),
                )
            except StoreError as e:
                done(idx, False, str(e), sid)

    def flush(self, timeout_ms: float | None = None) -> None:
        errors = []
        for c in list(self._clients.values()):
            try:
                c.flush(timeout_ms)
            except StoreError as e:
                errors.append(e)
        if errors and len(errors) == len(self._clients):
            raise errors[0]

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True)
        with self._lock:
            clients, self._clients = self._clients, {}
        for c in clients.values():
            c.close()

    # ---- routing ---------------------------------------------------------------------------------------
    def _keyed(self, op: str, entries: list, opts: dict, timeout_ms) -> list:
        if op in NATIVE_READS and entries and not opts:
            found = self._read_native(op, entries, self.state, timeout_ms)
            if found is not None:
                return found
        out: list = [None] * len(entries)
        todo = list(range(len(entries)))
        deadline = time.monotonic() + (timeout_ms if timeout_ms is not None else self.timeout_ms) / 1000
        pause = RESEND_FIRST_S
        while True:
            wrong = self._route(op, entries, opts, timeout_ms, self.state, todo, out)
            if not wrong:
                return out
            todo = wrong
            if time.monotonic() + pause >= deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)
            self._refresh()
            for i in todo:  # unanswered again (_stored_before sends only the entries without an answer)
                out[i] = None
        for i in todo:
            why = out[i][1] if isinstance(out[i], list) and len(out[i]) > 1 else ""
            out[i] = [WRONG_SHARD, f"{_key(entries[i])}: the shards disagree on its owner until the timeout ({why})"]
        return out

    def _route(self, op, entries, opts, timeout_ms, st: ClusterState, todo: list[int], out: list) -> list[int]:
        """Answer ``out[i]`` for entries ``todo``; returns the ones answered WRONG_SHARD (puts only)."""
        keys = [_key(entries[i]) for i in todo] if op not in STR_KEYED or len(todo) != len(entries) else entries
        cur = st.ring.owners(keys)
        prev = st.prev_ring.owners(keys) if st.moving() else None
        if op in PUTS and prev is not None:
            todo, cur, prev = self._stored_before(entries, todo, cur, prev, st, timeout_ms, out)
        parts: dict[str, list[int]] = {}
        for i, sid in zip(todo, cur):
            parts.setdefault(sid, []).append(i)
        self._send(op, entries, opts, timeout_ms, st.members, parts, out)
        if prev is not None and op in READS | REMOVES:
            moved = [(i, p) for i, c, p in zip(todo, cur, prev) if p != c]
            if op in READS:
                self._second(
                    op,
                    entries,
                    opts,
                    timeout_ms,
                    st.previous,
                    [(i, p) for i, p in moved if _missed(op, out[i])],
                    out,
                    keep_hits=True,
                )
            else:
                self._second(op, entries, opts, timeout_ms, st.previous, moved, out, keep_hits=False)
        return [i for i in todo if _code(out[i]) == WRONG_SHARD] if op in PUTS else []

    def _read_native(self, op: str, keys: list, st: ClusterState, timeout_ms) -> list | None:
        """``op`` (NATIVE_READS) of ``keys`` in one native fan-out over the shards that own them (module doc); None
        where it does not apply (a move is on, a shard's client is not on the raw plane, a key is not a str, an HA
        shard's leader did not answer): the caller routes in Python then."""
        if st.moving() or not st.ring.members:  # no shard: the Python path answers (misses, UNAVAILABLE)
            return None
        try:
            owner = native.ring_owners(keys, st.ring.points, st.ring.point_shard, len(st.ring.members))
        except TypeError:
            return None
        sids = st.ring.members
        mine = {s: np.flatnonzero(owner == s).tolist() for s in np.unique(owner).tolist()}  # each shard's keys
        used = mine.keys()  # a shard that owns none of the keys is not dialled
        clients = {s: self._client(sid, st.members[sid]) for s, sid in enumerate(sids) if s in used}
        if not all(_native_ok(c) for c in clients.values()):
            return None
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        errors: dict[str, StoreError] = {}
        payloads: dict[str, list] = {}
        with contextlib.ExitStack() as stack:
            held: list = [None] * len(sids)
            for s, c in clients.items():  # in ring order: concurrent fan-outs take the locks in one order
                try:
                    held[s] = stack.enter_context(c.held(op, timeout))
                except StoreError as e:
                    errors[sids[s]] = e
            fds, rids = [h.fd if h else -1 for h in held], [h.rid if h else 0 for h in held]
            if op == "exists":
                flags, answers = native.shard_exists(fds, rids, keys, owner, timeout)
            else:
                answers = native.shard_call(fds, rids, op, keys, owner, timeout)
            for s, (sid, h, answer) in enumerate(zip(sids, held, answers)):
                if h is None or answer is None or answer is True:
                    continue
                if op == "exists" or isinstance(answer, Exception):
                    errors[sid] = _refused(h, answer)
                    continue
                try:
                    payloads[sid] = _payload(h, answer, len(mine[s]))
                except StoreError as e:
                    errors[sid] = e
        if any(type(clients[s]) is LeaderClient and sid in errors for s, sid in enumerate(sids) if s in used):
            return None  # an HA shard's leader did not answer: the Python path retries on the next one
        if len(used) == len(st.members) and len(errors) == len(used):
            raise next(iter(errors.values()))
        if op == "exists":
            return (flags == 1).tolist()
        out: list = [None] * len(keys)
        for s, idx in mine.items():
            sid = sids[s]
            for i, answer in zip(idx, payloads[sid] if sid in payloads else [_down(op, sid, errors[sid])] * len(idx)):
                out[i] = answer
        return out

    def _stored_before(self, entries, todo, cur, prev, st, timeout_ms, out):
        """Puts of moved keys already stored on their previous owner answer EXISTS (the no-op of one master);
        returns the (todo, cur, prev) left to put."""
        moved = [(i, p) for i, c, p in zip(todo, cur, prev) if p != c]
        if not moved:
            return todo, cur, prev
        parts: dict[str, list[int]] = {}
        for i, p in moved:
            parts.setdefault(p, []).append(i)
        found: list = [None] * len(entries)
        self._send("exists", [_key(e) for e in entries], {}, timeout_ms, st.previous, parts, found)
        for i, _ in moved:
            if found[i] is True:
                out[i] = [EXISTS, "complete (on the key's previous shard)"]
        keep = [j for j, i in enumerate(todo) if out[i] is None]
        return [todo[j] for j in keep], [cur[j] for j in keep], [prev[j] for j in keep]

    def _second(self, op, entries, opts, timeout_ms, members, moved, out, keep_hits: bool) -> None:
        """Send ``moved`` [(index, previous owner)] to their previous owner; a read takes its answer, a remove
        counts as done if either owner removed the key."""
        parts: dict[str, list[int]] = {}
        for i, p in moved:
            parts.setdefault(p, []).append(i)
        second: list = [None] * len(entries)
        self._send(op, entries, opts, timeout_ms, members, parts, second)
        for i, _ in moved:
            if keep_hits:  # a read: the previous owner's answer when it has the key
                if not _missed(op, second[i]):
                    out[i] = second[i]
            elif _removed(second[i]):  # a remove: done if either owner removed the key
                out[i] = second[i]

    def _send(self, op, entries, opts, timeout_ms, members: dict, parts: dict, out: list) -> None:
        """One request per shard of ``parts`` (shard id -> entry indices), in parallel; fills ``out``."""
        if not parts:
            return
        answers = self._fan(op, entries, opts, timeout_ms, members, parts)
        if all(isinstance(a, StoreError) for a in answers.values()) and len(answers) == len(self.state.members):
            raise next(iter(answers.values()))
        for sid, idx in parts.items():
            a = answers[sid]
            if isinstance(a, StoreError):
                a = [_down(op, sid, a)] * len(idx)
            for i, answer in zip(idx, a):
                out[i] = answer

    def _fan(self, op, entries, opts, timeout_ms, members: dict, parts: dict | None = None) -> dict:
        """shard id -> its payload or the StoreError it raised. ``parts``: entry indices per shard (None: every
        member gets every entry)."""

        def one(sid):
            idx = None if parts is None else parts[sid]
            sub = entries if idx is None else [entries[i] for i in idx]
            try:
                if sid not in members:
                    raise StoreError(f"shard {sid} is not a member of {self.address}")
                return self._client(sid, members[sid]).call(op, sub, _subset(opts, idx), timeout_ms)
            except StoreError as e:
                return e

        sids = list(members if parts is None else parts)
        if len(sids) == 1:
            return {sids[0]: one(sids[0])}
        return dict(zip(sids, self._pool.map(one, sids)))

    def _client(self, sid: str, address: str | None = None):
        address = address or self.state.members.get(sid) or (self.state.previous or {}).get(sid)
        with self._lock:
            c = self._clients.get(address)
            if c is None:
                c = self._clients[address] = self._connect(address, self.timeout_ms, self.role)
            return c

    # ---- the membership ----------------------------------------------------------------------------------
    def _first_read(self) -> ClusterState:
        try:
            st = self._members.read()
        except StoreError as e:
            raise MasterUnreachable(self.address, self.timeout_ms, f"membership: {e}") from e
        if not st.members:
            raise StoreError(
                f"sharded store {self.address} has no shard yet: start masters with "
                f"`kvplugins master --cluster {self.address} --shard ID`"
            )
        return st

    def _refresh(self) -> None:
        """Ask the watcher for a fresh read and wait for it (up to 1 s)."""
        self._fresh.clear()
        self._wake.set()
        self._fresh.wait(1.0)

    def _watch(self) -> None:
        members = Membership(self.address)  # this thread's etcd client
        while not self._stop.is_set():
            try:
                st = members.read()
                if st.members:
                    if st.epoch != self.state.epoch:
                        log.info(
                            "sharded store %s: epoch %d, shards %s",
                            self.address,
                            st.epoch,
                            ", ".join(sorted(st.members)),
                        )
                    self.state = st
            except StoreError as e:
                log.warning("sharded store %s: membership not re-read: %s", self.address, e)
            self._fresh.set()
            self._wake.wait(POLL_S)
            self._wake.clear()


def _refused(held, answer) -> StoreError:
    """The StoreError of a shard's exchange that did not answer: its connection failed (``answer`` an exception),
    or its reply (bytes) to ``exists`` was a refusal or malformed."""
    if isinstance(answer, Exception):
        return held.failed(answer)
    try:
        held.payload(answer)
    except StoreError as e:
        return e
    return held.failed(ProtocolError("a malformed exists answer"))


def _native_ok(client) -> bool:
    """Whether a shard's client takes part in a native fan-out: a single master, or an HA pair on the raw plane
    (its leader's connection, LeaderClient.held)."""
    return type(client) is RawRpcClient or (type(client) is LeaderClient and client.plane == "raw")


def _payload(held, body: bytes, n: int) -> list:
    """The per-key answers of a shard's reply ``body`` to a native fan-out for ``n`` keys. Raises StoreError (a
    refusal) or MasterUnreachable (a malformed reply: the connection is closed)."""
    payload = held.payload(body)
    if type(payload) is not list or len(payload) != n:
        raise held.failed(ProtocolError(f"{held.op} answered {reprlib.repr(payload)} for {n} keys"))
    return payload


def _key(entry) -> str:
    return entry if isinstance(entry, str) else entry[0]


def _code(answer):
    return answer[0] if isinstance(answer, (list, tuple)) and answer and isinstance(answer[0], int) else None


def _missed(op: str, answer) -> bool:
    return answer is False if op == "exists" else _code(answer) != OK


def _removed(answer) -> bool:
    return answer == "removed" or _code(answer) == OK


def _down(op: str, sid: str, err: StoreError):
    """The per-entry answer for a key whose shard did not answer."""
    if op == "exists":
        return False
    if op == "remove_checked":
        return "missing"
    return [NOT_FOUND if op in READS else UNAVAILABLE, f"shard {sid} did not answer: {err}"]


def _subset(opts: dict, idx):
    """``opts`` with its per-entry lists (``xxh3``) cut to the entries ``idx`` (None: all)."""
    if idx is None or not opts or opts.get("xxh3") is None:
        return opts
    return {**opts, "xxh3": [opts["xxh3"][i] for i in idx]}
