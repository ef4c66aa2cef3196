"""The shard role of a master (``kvplugins master --shard ID --cluster shards://...``).

A watcher thread re-reads the membership (cluster/membership.py) every POLL_S, joins the ring once at start and
writes this shard's sweep reports. Joining (when the master holds no object: a master never joins with stale
keys): it announces itself, so nodes hand it extents, and becomes a member once it holds DRAM: its live segment
count has been above 0 and unchanged for SETTLE_S (the nodes' hand-over is done), or, with no segment, once the
hand-over wait (lease TTL + put timeout) and SETTLE_S more have passed since it announced (no node yet). On the
master's own thread (MasterService.handle / tick):
- ``route``: a put (``put_start``, ``put``) of a key this shard does not own answers WRONG_SHARD (the client
  re-reads the membership and retries): a client with a stale view never stores a key where readers will not
  look. Nor does a master with one: while its last membership read is older than MAX_VIEW_AGE_S (etcd slow or
  unreachable from it), every put answers WRONG_SHARD, so a put it acknowledges was routed by a ring at most that
  old (a change later than that may cost the key, like a put before the change).
- ``tick``: after each change this master drops, in slices of SWEEP_SLICE objects per tick, every key owned by
  neither the current nor the previous ring (then reports ``moved``); once the move window is over, every key it
  does not own now (then ``settled``). Until then the keys it lost stay readable by the clients' dual lookup.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from kvplugins.errors import StoreError
from kvplugins.store.cluster.membership import ClusterState, Membership, parse
from kvplugins.store.config import MasterConfig
from kvplugins.store.wire.protocol import WRONG_SHARD
from kvplugins.store.wire.schema import subset

log = logging.getLogger(__name__)
POLL_S = 0.5
SWEEP_SLICE = 8192
SETTLE_S = 2.0  # a joining master becomes a member once its live segment count held this long (module doc)
MAX_VIEW_AGE_S = 3.0  # puts are refused while the last membership read is older (module doc)


class ShardMember:
    """Shard ``shard`` of the store at ``cluster``, answering at ``address`` (what clients dial: host:port, or
    the shard's HA address etcd://...). ``window_ms``: the move window of a change this master makes."""

    def __init__(self, cluster: str, shard: str, address: str, window_ms: int, hand_over_s: float = 0.0):
        self.cluster, self.id, self.address, self.window_ms = cluster, shard, address, window_ms
        self.hand_over_s = hand_over_s  # how long a node waits before an extent another shard had is registrable
        self.state: ClusterState | None = None  # the latest read (set by the watcher thread)
        self.read_at = 0.0  # monotonic s of the latest read
        self.objects = -1  # the serving table's object count (set on each tick)
        self.segments = 0  # the serving table's live segments (set on each tick)
        self._held = (0, 0.0)  # (live segments, monotonic s since when that count holds)
        self.joined = False
        self._scan = None  # [service, (epoch, phase), object views, next index]
        self._done = (None, (0, 0))  # (service, target) of the last finished sweep
        self._swept = (0, 0)  # (moved, settled) epochs to report
        self._reported = (0, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"kvp-shard-{shard}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ---- the master's thread ---------------------------------------------------------------------------
    def route(self, op: str, entries, opts, run):
        """Run ``run(entries, opts)`` on the entries whose key (entry[0]) this shard owns; the others answer
        [WRONG_SHARD, why]."""
        st, age = self.state, time.monotonic() - self.read_at
        if st is None:
            return [[WRONG_SHARD, f"shard {self.id} has not read the membership yet; retry"]] * len(entries)
        if age > MAX_VIEW_AGE_S:
            why = f"shard {self.id} last read the membership {age:.1f} s ago (> {MAX_VIEW_AGE_S} s); retry"
            return [[WRONG_SHARD, why]] * len(entries)
        owners = st.ring.owners([e[0] for e in entries])
        own = [i for i, o in enumerate(owners) if o == self.id]
        if len(own) == len(entries):
            return run(entries, opts)
        out = [
            [WRONG_SHARD, f"{e[0]}: owned by shard {o} in epoch {st.epoch}, not by {self.id}"]
            for e, o in zip(entries, owners)
        ]
        if own:
            for i, answer in zip(own, run([entries[i] for i in own], subset(opts, own))):
                out[i] = answer
        return out

    def tick(self, service, now: float) -> None:
        """One slice of the sweep this master owes the current membership (module doc)."""
        self.objects = len(service.table)
        self.segments = len(service.segments.by_free_space())
        st = self.state
        if st is None:
            return
        target = (st.epoch, 2 if st.window_over() else 1)
        if self._done[0] is service and self._done[1] >= target:
            return
        moved, settled = st.swept.get(self.id, (0, 0))
        if self._done[0] is not service and moved >= st.epoch and (target[1] == 1 or settled >= st.epoch):
            self._done = (service, target)  # swept before by this shard (an HA leader's predecessor)
            return
        if self._scan is None or self._scan[0] is not service or self._scan[1] != target:
            self._scan = [service, target, service.table.lru(), 0]
        _, _, views, at = self._scan
        chunk = views[at : at + SWEEP_SLICE]
        self._scan[3] = at + len(chunk)
        keys = [o.key for o in chunk if o.alive()]
        if keys:
            keep = self._keeps(st, target[1], keys)
            drop = [k for k, ok in zip(keys, keep) if not ok]
            if drop:
                service.op_remove(drop, None, now)
                log.info("shard %s: dropped %d keys it no longer owns (epoch %d)", self.id, len(drop), st.epoch)
        if self._scan[3] >= len(views):
            self._scan, self._done = None, (service, target)
            self._swept = (st.epoch, st.epoch if target[1] == 2 else self._swept[1])

    def _keeps(self, st: ClusterState, phase: int, keys: list[str]) -> list[bool]:
        cur = [o == self.id for o in st.ring.owners(keys)]
        if phase == 2 or st.prev_ring is None:
            return cur
        return [c or o == self.id for c, o in zip(cur, st.prev_ring.owners(keys))]

    # ---- the watcher thread ----------------------------------------------------------------------------
    def _watch(self) -> None:
        members, complained = Membership(self.cluster), ""
        while True:
            try:
                began = time.monotonic()
                st = members.read()
                self.read_at, self.state = began, st  # (route: the ring as of when the read began)
                if self._swept != self._reported:
                    swept = self._swept
                    members.report(self.id, *swept)
                    self._reported = swept
                if not self.joined:
                    self._join(members, st)
                complained = ""
            except StoreError as e:
                if str(e) != complained:
                    log.warning("shard %s: %s", self.id, e)
                complained = str(e)
            if self._stop.wait(POLL_S):
                return

    def _join(self, members: Membership, st: ClusterState) -> None:
        if st.members.get(self.id) == self.address:
            self.joined = True
            return
        if self.id not in st.members and self.objects != 0:
            return  # first drop what this master holds (the sweep: it owns nothing yet)
        if self.id not in st.members:
            j = st.joining.get(self.id)
            if j is None or j.address != self.address:
                self.state = st = members.announce(self.id, self.address, self.window_ms)
                if self.id not in st.members:
                    log.warning("shard %s announced to %s at %s: it joins once nodes handed it extents",
                                self.id, self.cluster, self.address)  # fmt: skip
                    return
            elif not self._holds_dram(j.since):
                return
        self.state = members.join(self.id, self.address, self.window_ms)
        self.joined = True
        log.warning(
            "shard %s joined %s at %s (epoch %d, members %s)",
            self.id,
            self.cluster,
            self.address,
            self.state.epoch,
            ", ".join(sorted(self.state.members)),
        )

    def _holds_dram(self, since: float) -> bool:
        """Whether this joining master may join now (module doc). ``since``: unix s it announced."""
        n, now = self.segments, time.monotonic()
        if n != self._held[0]:
            self._held = (n, now)
        if n > 0:
            return now - self._held[1] >= SETTLE_S
        return time.time() - since >= self.hand_over_s + SETTLE_S


def shard_defaults(cfg):
    """``cfg`` (MasterConfig) with an HA shard's etcd prefix defaulted to <cluster prefix>/shard/<id> (its pair
    elects under it)."""
    if cfg.shard and cfg.etcd and cfg.etcd_prefix == MasterConfig.etcd_prefix:
        cfg = dataclasses.replace(cfg, etcd_prefix=f"{parse(cfg.cluster)[1]}/shard/{cfg.shard}")
    return cfg


def start_shard(cfg, address: str) -> ShardMember | None:
    """The started shard role of a master with --shard (answering at ``address``), else None."""
    if not cfg.shard:
        return None
    hand_over_s = (cfg.lease_ttl_ms + cfg.put_timeout_ms) / 1000
    member = ShardMember(cfg.cluster, cfg.shard, address, cfg.shard_move_window_ms, hand_over_s)
    member.start()
    return member
