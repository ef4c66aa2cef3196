"""The membership of a sharded store, kept in etcd: which masters (shards) exist, where they answer, and the
state of the last change (a *move*).

Address of a sharded store: ``shards://host:port[,host:port...]/prefix`` (the etcd cluster and a key prefix).
Keys under the prefix:
- ``{prefix}/ring``: JSON ``{"epoch", "members": {shard id: master address}, "previous": {...} | null,
  "changed_at": unix s, "window_ms", "joining": {shard id: {"address", "since": unix s}}}``. A member's address is what master_client takes: ``host:port`` for a
  single master, ``etcd://host:port/{prefix}/shard/{id}`` for an HA pair (ha/).
- ``{prefix}/swept/{id}``: JSON ``{"moved": epoch, "settled": epoch}``, written by shard ``id``'s master:
  ``moved`` = it dropped every key owned by neither the current nor the previous ring of that epoch,
  ``settled`` = the move window passed and it dropped every key it does not own now.

A master joins in two steps. It first *announces* itself (``joining``; the epoch stays): it owns no key yet, but
nodes already hand it their share of extents (node/extents.py; an extent leaving a shard is registrable again
only after that shard's lease TTL + put timeout). Once its master holds DRAM (master/shard.py) it *joins*: it
becomes a member and owns its part of the ring. So no key is ever owned by a shard without DRAM (before, puts of
a new shard's keys were StoreFull for that wait, 21.6 s in the cluster runs; issue #34). The first master of an
empty ring joins at once.

A change (a master joins, or ``kvplugins shard remove``) bumps the epoch, keeps the old member set as
``previous`` and is refused while any member has not yet reported ``moved`` for the current epoch (so a range
never returns to a master still holding stale keys of it). Clients read through both rings while a move is on
(``ClusterState.moving``). Every write is a compare-and-swap on the ring key's value.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from functools import cached_property

from kvplugins.errors import ConfigError, StoreError
from kvplugins.store.cluster.etcd import Etcd, b64, parse_endpoint, put_op
from kvplugins.store.cluster.ring import Ring

SCHEME = "shards://"


def is_sharded(address: str) -> bool:
    return address.startswith(SCHEME)


def parse(address: str) -> tuple[str, str]:
    """'shards://host:port[,host:port]/prefix' -> (etcd URL(s) for Etcd, prefix). Raises ConfigError."""
    if not is_sharded(address):
        raise ConfigError(
            f"{address!r} is not a sharded store address; use shards://host:port/prefix "
            "(the etcd endpoint and the cluster's key prefix)"
        )
    endpoints, prefix = parse_endpoint("etcd://" + address[len(SCHEME) :])
    if not prefix:
        raise ConfigError(
            f"sharded store address {address!r} needs a key prefix, e.g. shards://127.0.0.1:2379/kvplugins/pool"
        )
    return ",".join(f"http://{h}:{p}" for h, p in endpoints), prefix


@dataclass(frozen=True)
class Joining:
    """A master that announced itself (module doc): where it answers and since when (unix s)."""

    address: str
    since: float


@dataclass(frozen=True)
class ClusterState:
    """One read of the membership (see the module doc). ``swept``: shard id -> (moved, settled) epochs."""

    epoch: int = 0
    members: dict = field(default_factory=dict)
    previous: dict | None = None
    changed_at: float = 0.0
    window_ms: int = 0
    swept: dict = field(default_factory=dict)
    joining: dict = field(default_factory=dict)  # shard id -> Joining

    @cached_property
    def ring(self) -> Ring:
        return Ring(self.members)

    @cached_property
    def prev_ring(self) -> Ring | None:
        return None if self.previous is None else Ring(self.previous)

    def window_over(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.changed_at + self.window_ms / 1000

    def moving(self, now: float | None = None) -> bool:
        """Whether keys may still be on their previous owner: the window runs, or a member that was also one
        before has not dropped its moved-away keys yet."""
        if self.previous is None or set(self.previous) == set(self.members):
            return False
        return not self.window_over(now) or any(
            self.swept.get(m, (0, 0))[1] < self.epoch for m in self.members if m in self.previous
        )

    @cached_property
    def extent_holders(self) -> dict:
        """Shard id -> address of every master nodes give extents to: the members, the joining ones and, while
        the move window runs, the ones just removed (their keys are read from them until then: dual lookup)."""
        leaving = {} if self.previous is None or self.window_over() else self.previous
        return {**leaving, **{sid: j.address for sid, j in self.joining.items()}, **self.members}

    def unswept(self) -> list[str]:
        """Members that have not reported ``moved`` for this epoch (a new change waits for them)."""
        return [m for m in self.members if self.swept.get(m, (0, 0))[0] < self.epoch]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "epoch": self.epoch,
                "members": self.members,
                "previous": self.previous,
                "changed_at": self.changed_at,
                "window_ms": self.window_ms,
                "joining": {sid: {"address": j.address, "since": j.since} for sid, j in self.joining.items()},
            },
            sort_keys=True,
        ).encode()


class Membership:
    """Reads and changes the membership at ``address`` (shards://...). Raises StoreError when etcd does not
    answer. One instance per thread (the etcd client is not thread-safe)."""

    def __init__(self, address: str, timeout_s: float = 2.0):
        url, self.prefix = parse(address)
        self.address = address
        self.etcd = Etcd(url, timeout_s)
        self.ring_key = f"{self.prefix}/ring"

    def read(self) -> ClusterState:
        return self._read()[0]

    def _read(self) -> tuple[ClusterState, bytes | None]:
        """(the state, the ring key's raw value: what a change compares against)."""
        raw = self.etcd.get(self.ring_key)
        swept = {
            k.rsplit("/", 1)[-1]: tuple(json.loads(v).get(n, 0) for n in ("moved", "settled"))
            for k, v in self.etcd.range_prefix(f"{self.prefix}/swept/")
        }
        if raw is None:
            return ClusterState(swept=swept), None
        d = json.loads(raw)
        joining = {sid: Joining(j["address"], j["since"]) for sid, j in d.get("joining", {}).items()}
        return ClusterState(
            d["epoch"], d["members"], d["previous"], d["changed_at"], d["window_ms"], swept, joining
        ), raw

    def report(self, shard: str, moved: int, settled: int) -> None:
        self.etcd.txn(
            [], [put_op(f"{self.prefix}/swept/{shard}", json.dumps({"moved": moved, "settled": settled}).encode())]
        )

    def announce(self, shard: str, address: str, window_ms: int) -> ClusterState:
        """Announce ``shard`` at ``address`` as joining (module doc; the first master of an empty ring joins at
        once). Raises StoreError if another change won the race (retry)."""

        def change(st: ClusterState):
            if shard in st.members or st.joining.get(shard, Joining("", 0)).address == address:
                return None
            if not st.members:
                return _moved(st, {shard: address}, window_ms)
            since = st.joining[shard].since if shard in st.joining else time.time()
            return dataclasses.replace(st, joining={**st.joining, shard: Joining(address, since)})

        return self._change(change, f"announce shard {shard}")

    def join(self, shard: str, address: str, window_ms: int) -> ClusterState:
        """Add ``shard`` at ``address`` (or update its address; no keys move then). Raises StoreError if a
        move is still being swept (retry later) or another change won the race."""

        def change(st: ClusterState):
            if st.members.get(shard) == address:
                return None
            if shard in st.members:  # a restarted master at a new address: same keys, same epoch
                return dataclasses.replace(st, members={**st.members, shard: address})
            return _moved(st, {**st.members, shard: address}, window_ms)

        return self._change(change, f"add shard {shard}")

    def remove(self, shard: str, window_ms: int, force: bool = False) -> ClusterState:
        """Remove ``shard``: its keys go to the others (read from it while the move window runs). ``force``:
        do not wait for unswept members (one is dead). Raises StoreError (unknown shard, move in progress)."""

        def change(st: ClusterState):
            if shard in st.joining and shard not in st.members:  # announced only: it owns no key yet
                return dataclasses.replace(st, joining={k: v for k, v in st.joining.items() if k != shard})
            if shard not in st.members:
                raise StoreError(
                    f"shard {shard!r} is not a member of {self.address} (members: {sorted(st.members) or 'none'}, joining: {sorted(st.joining) or 'none'})"
                )
            return _moved(st, {k: v for k, v in st.members.items() if k != shard}, window_ms)

        return self._change(change, f"remove shard {shard}", force)

    def _change(self, change, what: str, force: bool = False) -> ClusterState:
        st, raw = self._read()
        new = change(st)
        if new is None:
            return st
        if new.epoch != st.epoch and not force and st.unswept():
            raise StoreError(
                f"{what}: the move of epoch {st.epoch} is still being swept by "
                f"{', '.join(st.unswept())}; retry in a few seconds (or --force if that master is dead)"
            )
        cond = (
            {"key": b64(self.ring_key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            if raw is None
            else self.etcd.value_is(self.ring_key, raw)
        )
        if not self.etcd.txn([cond], [put_op(self.ring_key, new.to_json())]):
            raise StoreError(f"{what}: the membership changed meanwhile; retry")
        return new


def _moved(st: ClusterState, members: dict, window_ms: int) -> ClusterState:
    """The state after a change of the member set: previous = the members before (None if there were none); a
    shard that became a member is no longer joining."""
    joining = {k: v for k, v in st.joining.items() if k not in members}
    return ClusterState(st.epoch + 1, members, dict(st.members) or None, time.time(), window_ms, joining=joining)
