"""A store node of a sharded store: its DRAM as ``shard_extents`` equal extents, each its own exported region
registered as a segment with one shard's master (OwnedSegment: heartbeats, re-registration).

Extents go to every member and to masters that announced they join (they join once they hold DRAM, so no
shard ever owns keys without any). Masters of a sharded store own disjoint segment sets: a master allocates only in segments registered with it,
so no two masters ever hand out the same bytes and no cross-master allocation protocol is needed. Every node
spreads its extents evenly over the shards (``assign``), so each shard gets about 1/N of every node's DRAM,
as it gets about 1/N of the keys (ring.py). On a membership change a node moves as few extents as it can: an
extent leaving a shard is unregistered there (its objects become misses on that shard) and is registered with
its new shard only after the old shard's lease TTL and put timeout have passed, so no reader of a lease and no
writer of a put_start the old shard granted ever touches bytes the new shard has handed out since.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
import time

import xxhash

from kvplugins.errors import StoreError
from kvplugins.store.client.connect import control_client
from kvplugins.store.node.segment import OwnedSegment
from kvplugins.store.cluster.membership import Membership

log = logging.getLogger(__name__)
POLL_S = 0.5
EXTENT_ALIGN = 1 << 21


def assign(current: list, members, salt: str) -> list:
    """The shard of each extent: every member gets len(current) // N extents, and the remainder goes to the
    members first in an order salted by ``salt`` (the node), so over many nodes the extra extents spread.
    Extents already on a member within its quota stay there (a change moves the fewest extents)."""
    order = sorted(members, key=lambda m: xxhash.xxh3_64_intdigest(f"{salt}/{m}".encode()))
    n, k = len(current), len(order)
    if not k:
        return [None] * n
    quota = {m: n // k + (j < n % k) for j, m in enumerate(order)}
    out = [None] * n
    for i, m in enumerate(current):
        if quota.get(m, 0) > 0:
            out[i], quota[m] = m, quota[m] - 1
    spare = iter([m for m in order for _ in range(quota[m])])
    return [m if m is not None else next(spare) for m in out]


class ShardedSegments:
    """``size`` bytes in ``extents`` extents on ``engine``, kept registered with the shards of ``address``
    (shards://...). Raises StoreError if the membership cannot be read at start."""

    def __init__(self, engine, address: str, size: int, extents: int, cfg):
        self.engine, self.address, self.cfg = engine, address, cfg
        per = size // extents // EXTENT_ALIGN * EXTENT_ALIGN or size // extents
        self.regions = [engine.alloc_shared(per, export=True, populate=cfg.prefault) for _ in range(extents)]
        self.name = engine.descriptor().segment_id
        self.owner: list = [None] * extents  # shard id per extent (None: not registered anywhere)
        self.segs: list = [None] * extents  # its OwnedSegment
        self.rpcs: list = [None] * extents
        self.addrs: list = [None] * extents  # the address it was registered at
        self.free_at = [0.0] * extents  # monotonic s: registrable again after a hand-over wait
        self.hold_s: list = [0.0] * extents  # the owning shard's lease TTL + put timeout (s)
        self._members = Membership(address)
        self._stop = threading.Event()
        self.rebalance()
        self._thread = threading.Thread(target=self._watch, name="kvp-extents", daemon=True)
        self._thread.start()

    def rebalance(self) -> None:
        """Read the membership; unregister extents that must move, register the free ones with their shard."""
        st = self._members.read()
        holders = st.extent_holders  # members and joining masters (cluster/membership.py)
        target = assign(self.owner, holders, self.name)
        now = time.monotonic()
        for i, want in enumerate(target):
            if self.owner[i] is not None and (self.owner[i] != want or self.addrs[i] != holders[want]):
                self._release(i, now)
            if self.owner[i] is None and want is not None and now >= self.free_at[i]:
                self._register(i, want, holders[want])

    def placements(self) -> dict:
        """Shard id -> segment names of this node registered with it."""
        out: dict = {}
        for m, seg in zip(self.owner, self.segs):
            if m is not None:
                out.setdefault(m, []).append(seg.name)
        return out

    def close(self) -> None:
        """Stop watching and release every extent at once: a stop waits for one unregister (at most its 1 s
        timeout when a master does not answer), not one per extent."""
        self._stop.set()
        self._thread.join(timeout=5)
        held = [i for i in range(len(self.regions)) if self.owner[i] is not None]
        if held:
            now = time.monotonic()
            with ThreadPoolExecutor(len(held), thread_name_prefix="kvp-release") as pool:
                list(pool.map(lambda i: self._release(i, now), held))

    def _register(self, i: int, shard: str, address: str) -> None:
        rpc = control_client(address, self.cfg.rpc_timeout_ms, "node")
        try:
            info = rpc.call("info")
            self.segs[i] = OwnedSegment(self.engine, 0, rpc, self.cfg.heartbeat_interval_ms, region=self.regions[i])
        except StoreError as e:
            rpc.close()
            log.warning("extent %d not registered with shard %s (%s): %s; retrying", i, shard, address, e)
            return
        self.owner[i], self.rpcs[i], self.addrs[i] = shard, rpc, address
        self.hold_s[i] = (info.get("lease_ttl_ms", 0) + info.get("put_timeout_ms", 0)) / 1000
        log.info("extent %d (%d bytes) -> shard %s as %s", i, self.regions[i].length, shard, self.segs[i].name)

    def _release(self, i: int, now: float) -> None:
        log.info("extent %d leaves shard %s; registrable again in %.1f s", i, self.owner[i], self.hold_s[i])
        self.segs[i].close()
        self.rpcs[i].close()
        self.owner[i] = self.segs[i] = self.rpcs[i] = self.addrs[i] = None
        self.free_at[i] = now + self.hold_s[i]

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.rebalance()
            except StoreError as e:
                log.warning("sharded store %s: membership not re-read: %s", self.address, e)
            except Exception:  # noqa: BLE001 - a dead watcher would leave extents with a shard that left
                log.exception("sharded store %s: rebalance failed; watching goes on", self.address)
