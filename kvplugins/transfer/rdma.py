"""RDMA transport: one-sided RDMA READ/WRITE over RC queue pairs (native verbs: rdma_verbs.py), several NICs,
failover to TCP.

Lifecycle (within a TransferEngine, kvplugins/transfer/api.py):
  1. ``RdmaTransport.probe(config, tcp)``  opens every usable NIC (kvplugins/transfer/nics.py), or returns
                                 (None, reason) when there is none or no libibverbs: the engine logs the reason once
                                 and runs without RDMA. It registers the "rdma" control handler on the TCP
                                 transport's server: queue pairs are set up over that authenticated connection
                                 (no second server).
  2. ``add_region``              registers the region as an MR on every NIC (local write; remote read/write when
                                 exported); ``region_info`` publishes its address and one rkey per NIC in the
                                 descriptor's region table; ``endpoint`` publishes the NICs (name, GID, LID, MTU,
                                 subnet, NUMA node).
  3. ``transfer`` / ``transfer_spans``  per peer: the spans as columns (rdma_wrs.py: no Python object per span or
                                 work request), striped over the healthy NIC paths by measured throughput; per
                                 path one native call (rdma_verbs.run_spans) cuts them at ``rdma_max_wr``, deals
                                 the work requests over ``rdma_qps_per_peer`` QPs, posts them as chains with
                                 selective signalling and completes them. Spans of a failed path are retried once
                                 on another path; what still fails is TransferFailed, which the router retries on
                                 TCP.
                                 A dead QP is rebuilt, and a down path probed back, by a background thread
                                 every ``rdma_probe_ms`` (the queue pairs and their set-up: rdma_qps.py).
  4. ``remove_region``, ``close``.
A batch mutates only its entries' destination bytes. ``endpoint``, ``reaches`` and ``stats`` are always safe.
Device memory (Region.device, transfer/device.py) is not registered as an MR (no dmabuf MR yet): TCP serves it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Iterator

import numpy as np

from kvplugins.errors import TransferError, TransferFailed
from kvplugins.transfer import rdma_verbs as verbs
from kvplugins.transfer import rdma_wrs
from kvplugins.transfer.api import Region, RegionInfo, SegmentDescriptor
from kvplugins.transfer.config import TransferConfig
from kvplugins.transfer.nics import discover
from kvplugins.transfer.rdma_fast import FastRoutes
from kvplugins.transfer.rdma_paths import Path, PathStats, numa_of, pair, stripe
from kvplugins.transfer.rdma_qps import QpPool
from kvplugins.transfer.transport import Deadline, Entry, Op, Transport

log = logging.getLogger("kvplugins.transfer.rdma")


class RdmaTransport(Transport):
    """One-sided READ/WRITE to peers that offer "rdma" and export the region with rkeys (module doc)."""

    name = "rdma"

    @classmethod
    def probe(cls, config: TransferConfig, tcp) -> tuple["RdmaTransport | None", str | None]:
        """(transport, None), or (None, why RDMA is absent here: no libibverbs, no device, no active port)."""
        why = verbs.load_error()
        if why:
            return None, why
        wanted = [d.strip() for d in config.rdma_devices.split(",") if d.strip()] or None
        found = discover(wanted)
        usable = [n for n in found.nics if n.usable]
        if not usable:
            return None, found.reason or "no usable RDMA port"
        return cls(config, tcp, usable), None

    def __init__(self, config: TransferConfig, tcp, nics: list):
        self._cfg = config
        self._nics = [verbs.Nic(n) for n in nics]
        self._stats = PathStats(config.rdma_probe_ms / 1000)
        self._lock = threading.Lock()
        self._keys: dict[int, tuple[int, list]] = {}  # region id -> (access, MR per NIC)
        self._numa: dict[int, int] = {}
        self._pairs: dict[tuple, list[Path]] = {}  # a peer's subnets -> paths (a few peers' worth)
        self._qps = QpPool(config, tcp, self._nics, self._stats)
        self._fast: dict[str, Path] = {}  # peer -> the path its last good batch took (fast_spans)
        self.fast = FastRoutes(config)  # small batches in one native call (rdma_fast.py)
        log.info("rdma transport on %s", ", ".join(f"{n.info.name} (GID {n.info.gid})" for n in self._nics))

    # -- endpoint and regions ----------------------------------------------------------------------
    def endpoint(self) -> dict[str, Any]:
        """The NICs peers connect to, as parallel lists: names, GIDs, LIDs, MTUs (bytes), subnets, NUMA nodes."""
        infos = [n.info for n in self._nics]
        return {
            "nics": [i.name for i in infos],
            "gids": [i.gid for i in infos],
            "lids": [i.lid for i in infos],
            "mtus": [i.active_mtu for i in infos],
            "nets": [i.ipv4 or "" for i in infos],
            "numa": [i.numa_node for i in infos],
        }

    def add_region(self, region: Region) -> None:
        """Register ``region`` as an MR on every NIC. Where one NIC refuses it (e.g. ENOMEM over RLIMIT_MEMLOCK),
        the region is not RDMA-registered at all (the others are undone): TCP serves it, with a warning. Device
        memory is not registered (no dmabuf MR yet): TCP serves it, staged."""
        if region.device is not None:
            return
        access, mrs = self._access(region), []
        for nic in self._nics:
            try:
                mrs.append(nic.register(region.addr, region.length, access))
            except TransferFailed as e:  # ENOMEM over RLIMIT_MEMLOCK and kin: TCP serves this region
                log.warning(
                    "rdma: could not register region %d (%d bytes) on %s: %s; run `kvplugins doctor` "
                    "(RLIMIT_MEMLOCK); TCP serves it",
                    region.region_id,
                    region.length,
                    nic.info.name,
                    e,
                )
                for done in self._nics[: len(mrs)]:
                    done.deregister(region.addr, region.length, access)
                return
        with self._lock:
            self._keys[region.region_id] = (access, mrs)
            self._numa[region.region_id] = numa_of(region.addr)
        self.fast.add_local(region, [mr.lkey for mr in mrs])

    def region_info(self, region: Region, info: RegionInfo) -> RegionInfo:
        with self._lock:
            entry = self._keys.get(region.region_id)
        if entry is None:
            return info
        return replace(info, rdma=(region.addr, tuple(mr.rkey for mr in entry[1])))

    def remove_region(self, region: Region) -> None:
        self.fast.drop_local(region.region_id)  # waits for its fast batches in flight
        with self._lock:
            entry = self._keys.pop(region.region_id, None)
            self._numa.pop(region.region_id, None)
        if entry is not None:
            for nic in self._nics:
                nic.deregister(region.addr, region.length, entry[0])

    @staticmethod
    def _access(region: Region) -> int:
        remote = verbs.ACCESS_REMOTE_READ if region.exported else 0
        if region.peers_write:
            remote |= verbs.ACCESS_REMOTE_WRITE
        return remote if region.readonly else verbs.ACCESS_LOCAL_WRITE | remote

    def reaches(self, remote: SegmentDescriptor, region: RegionInfo) -> bool:
        ep = remote.transports.get("rdma")
        if not isinstance(ep, dict) or region.rdma is None or "tcp" not in remote.transports:
            return False
        nics = ep.get("nics")
        if not isinstance(nics, list) or not nics or len(region.rdma[1]) != len(nics):
            return False
        lists = [ep.get(k) for k in ("gids", "lids", "mtus", "nets")]
        return all(isinstance(v, list) and len(v) == len(nics) for v in lists) and bool(self._paths(ep))

    def _paths(self, ep: dict) -> list[Path]:
        """The paths to a peer's NICs (rdma_paths.pair), cached per its list of subnets."""
        nets = tuple(ep["nets"])
        paths = self._pairs.get(nets)
        if paths is None:
            paths = self._pairs[nets] = pair([n.info.ipv4 for n in self._nics], [net or None for net in nets])
        return paths

    # -- batches -----------------------------------------------------------------------------------
    def transfer(self, op: Op, entries: list[Entry], deadline: Deadline) -> list[TransferError | None]:
        status: list[TransferError | None] = [None] * len(entries)
        by_peer: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            by_peer.setdefault(e.remote.segment_id, []).append(i)
        for seg, idxs in by_peer.items():
            self._qps.remember(entries[idxs[0]].remote)
            for i in idxs:
                if entries[i].local.region_id not in self._keys:
                    status[i] = _no_mr(entries[i].local)
            ok = [i for i in idxs if status[i] is None]
            if not ok:
                continue
            es = [entries[i] for i in ok]
            spans = rdma_wrs.coalesce(
                [e.local_addr for e in es],
                [e.remote_region.rdma[0] + e.remote_offset for e in es],
                [e.length for e in es],
                [self._lkeys(e.local.region_id) for e in es],
                [e.remote_region.rdma[1] for e in es],
            )
            for k, err in self._run(op, seg, spans, {e.local.region_id for e in es}, deadline):
                status[ok[k]] = status[ok[k]] or err
        return status

    def transfer_spans(self, op: Op, batch, deadline: Deadline) -> list[TransferError | None] | None:
        """The array form (the store's path): the router's coalesced spans go to the native call as columns."""
        self._qps.remember(batch.remote)
        n = len(batch)
        status: list[TransferError | None] = [None] * n
        uniq = {id(r): r for r in batch.regions}
        if any(r.region_id not in self._keys for r in uniq.values()):
            for j, r in enumerate(batch.regions):
                if r.region_id not in self._keys:
                    status[j] = _no_mr(r)
            keep = [j for j in range(n) if status[j] is None]
            if keep:
                for j, err in zip(keep, self.transfer_spans(op, batch.subset(keep), deadline) or []):
                    status[j] = err
            return status
        if len(uniq) == 1:
            lkeys = [[k] for k in self._lkeys(batch.regions[0].region_id)]
        else:
            lkeys = [list(col) for col in zip(*(self._lkeys(r.region_id) for r in batch.regions))]
        base, rkeys = batch.info.rdma
        roffs = batch.roffs
        raddr = [base + r for r in roffs] if isinstance(roffs, list) else roffs + np.uint64(base)
        spans = rdma_wrs.Spans(batch.addrs, raddr, batch.lens, lkeys, [[k] for k in rkeys])
        for k, err in self._run(op, batch.remote.segment_id, spans, {r.region_id for r in uniq.values()}, deadline):
            status[k] = status[k] or err
        return None if status.count(None) == n else status

    def fast_spans(
        self, op: Op, remote: SegmentDescriptor, region_id: int, spans: tuple, deadline: Deadline, regions
    ) -> bool:
        """A small batch in one native call (issue #35): ``spans`` = (local addresses, remote offsets, lengths), int
        lists of at most spans.SMALL spans and ``rdma_max_wr`` bytes (a batch _stripe gives one path), to region
        ``region_id`` of ``remote`` over the path the peer's last good batch took, when every span lies in one
        local registered region with an MR (``regions``: the engine's RegionTable; writable for a read) and inside
        the remote region. True once every span completed; False where it does not apply or a work request failed
        (that path is marked as _round marks it): the caller then runs the batch its general way (the same bytes
        moved again), which names any error and falls back."""
        seg = remote.segment_id
        path = self._fast.get(seg)
        addrs, roffs, lens = spans
        if path is None or not lens or sum(lens) > self._cfg.rdma_max_wr:  # more: striped over the paths
            return False
        try:
            info = remote.region(region_id)
        except TransferError:  # OutOfRange: the general path names it
            return False
        local = regions.index.find(addrs[0], lens[0])
        entry = self._keys.get(local.region_id) if local is not None else None
        if entry is None or info.rdma is None or (op is Op.READ and local.readonly):
            return False
        lo, hi = local.addr, local.addr + local.length
        for a, r, n in zip(addrs, roffs, lens):
            if (
                type(a) is not int
                or type(r) is not int
                or not 0 < n <= info.length - r
                or r < 0
                or a < lo
                or a + n > hi
            ):
                return False
        pin = regions.pin(local)  # the memory stays mapped until the work requests completed
        qps, _ = self._qps.acquire(seg, path, 1, deadline)
        if not qps:
            return False
        base, rkeys = info.rdma
        start = time.monotonic()
        try:
            posted, runs, lost = verbs.run_spans(
                op is Op.READ,
                qps,
                addrs,
                [entry[1][path.local].lkey],
                [base + r for r in roffs],
                [rkeys[path.remote]],
                lens,
                int(self._cfg.rdma_max_wr),
                deadline.at,
                self._cfg.rdma_signal_every,
            )
        finally:
            self._qps.release([((seg, path), q) for q in qps])
            del pin
        failed = any(r.error for r in runs)
        if failed:  # marks the path as a failed batch does (a small batch's timing is no throughput sample)
            self._settle(seg, path, runs, start, set())
        done = not failed and not lost
        if done:  # the next small batch there runs natively from the API's entry
            self.fast.put(remote, region_id, qps[0], path, base, info.length, rkeys[path.remote])
        self._stats.add("wrs", posted)
        self._stats.add("fast_batches", int(done))
        return done

    def _lkeys(self, region_id: int) -> list[int]:
        return [mr.lkey for mr in self._keys[region_id][1]]

    def _run(
        self, op: Op, seg: str, spans: rdma_wrs.Spans, regions: set[int], deadline: Deadline
    ) -> Iterator[tuple[int, TransferFailed]]:
        """Run ``spans`` to peer ``seg`` over its healthy paths; a failed path's spans get one more round on the
        others. Yields (caller's entry index, TransferFailed) for each entry of a span that failed."""
        todo: list[int] | None = None  # None: every span
        why, tried = "no healthy RDMA path", set()
        paths = self._live_paths(seg, regions)
        if len(paths) > 1:  # striped: paths share a big span's work requests
            spans = spans.cut(int(self._cfg.rdma_max_wr))
        while todo is None or todo:
            if tried:
                paths = [p for p in self._live_paths(seg, regions) if p not in tried]
            if not paths:
                break
            todo, why, bad = self._round(op, seg, spans, todo, paths, deadline)
            tried |= bad
            if not bad:
                break
        left = list(range(len(spans))) if todo is None else todo
        if left:
            err = TransferFailed(f"rdma to {seg}: {why}")
            for k in spans.callers(left):
                yield k, err

    def _live_paths(self, seg: str, regions: set[int]) -> list[Path]:
        ep, up = self._qps.endpoint(seg), self._qps.nics_up
        paths = [p for p in (self._paths(ep) if ep else []) if up[p.local] and self._stats.up((seg, p.local, p.remote))]
        near = [
            p for p in paths if all(self._numa.get(r, -1) in (-1, self._nics[p.local].info.numa_node) for r in regions)
        ]
        return near or paths

    def _round(self, op: Op, seg: str, spans: rdma_wrs.Spans, todo: list[int] | None, paths: list[Path], deadline):
        """One striped attempt of spans ``todo`` (None: all); returns (spans that failed, why, failed paths)."""
        owner = self._stripe(seg, spans, todo, paths)
        failed: list[int] = []
        why, bad, held = "", set(), []
        for k, path in enumerate(paths):
            mine = todo if owner is None else [j for j, o in owner if o == k]
            count = len(spans) if mine is None else len(mine)
            if not count:
                continue
            qps, err = self._qps.acquire(seg, path, count, deadline)
            if not qps:
                failed += range(len(spans)) if mine is None else mine
                why = err
                bad.add(path)
                continue
            held += [((seg, path), q) for q in qps]
            start = time.monotonic()
            posted, runs, lost = verbs.run_spans(
                op is Op.READ,
                qps,
                *spans.path(mine, path.local, path.remote),
                int(self._cfg.rdma_max_wr),
                deadline.at,
                self._cfg.rdma_signal_every,
            )
            self._stats.add("wrs", posted)
            why = self._settle(seg, path, runs, start, bad) or why
            failed += lost if mine is None else [mine[j] for j in lost]
            if not lost and path not in bad:
                self._fast[seg] = path
        self._stats.add("striped_batches", int(owner is not None and len({o for _, o in owner}) > 1))
        self._qps.release(held)
        return failed, why, bad

    def _stripe(self, seg: str, spans: rdma_wrs.Spans, todo: list[int] | None, paths: list[Path]):
        """(span, path index) for each span of ``todo`` (None: all), by measured throughput (rdma_paths.stripe; a
        small batch takes the best path); None for one path (every span on it)."""
        if len(paths) == 1:
            return None
        idx = list(range(len(spans))) if todo is None else todo
        lengths = [int(spans.length[j]) for j in idx]
        speeds = [self._nics[p.local].info.speed_gbps or 1.0 for p in paths]
        weights = [self._stats.weight((seg, p.local, p.remote), s * 125e6) for p, s in zip(paths, speeds)]
        if sum(lengths) <= self._cfg.rdma_max_wr:
            weights = [w if w == max(weights) else 0.0 for w in weights]
        return list(zip(idx, stripe(lengths, weights)))

    def _settle(self, seg: str, path: Path, runs: list, start: float, bad: set) -> str:
        """Telemetry of one path's queue pairs; a failed one marks the path bad. Returns why it failed ("")."""
        key, name = (seg, path.local, path.remote), self._nics[path.local].info.name
        end = max([r.finished_at for r in runs if r.finished_at] or [time.monotonic()])
        self._stats.sample(key, f"{name}->{path.remote}", sum(r.nbytes for r in runs), end - start)
        error = next((r.error for r in runs if r.error), "")
        if error:
            self._fast.pop(seg, None)
            self.fast.drop(seg)
        if error and path not in bad:
            bad.add(path)
            self._stats.failed(key)
            log.warning(
                "rdma path %s -> %s of %s failed (%s); retrying its work on another path", name, path.remote, seg, error
            )
        return f"{name}: {error}" if error else ""

    def fast_failed(self, seg: str) -> None:
        """A native fast batch to peer ``seg`` failed (its queue pair is killed): forget the peer's routes and mark
        the path as a failed batch does; the caller runs the batch its general way."""
        self._fast.pop(seg, None)
        self._qps.drop_dead(seg)
        for path in self.fast.drop(seg):
            self._stats.failed((seg, path.local, path.remote))
            log.warning(
                "rdma path %s -> %s of %s failed in a small batch; retrying its work on the general path",
                self._nics[path.local].info.name,
                path.remote,
                seg,
            )

    def stats(self) -> dict[str, Any]:
        """wrs posted, fast_batches (small batches done by fast_spans or natively from the engine's entry),
        path_failures, qp_rebuilds, striped_batches, path_mbps (measured MB/s per peer and path), path_bytes (per
        local NIC -> peer NIC index), paths_down, qps (ours), qps_served (for peers), nics_up, native_batches (of
        fast_batches, those done natively from the engine's entry); "native": their reads, writes, entries and bytes
        (the router folds them into its counters)."""
        out = {**self._stats.snapshot(), **self._qps.stats()}
        native = self.fast.counts()
        out["wrs"] = out.get("wrs", 0) + native.pop("wrs")
        out["native_batches"] = native["reads"] + native["writes"]
        out["fast_batches"] = out.get("fast_batches", 0) + out["native_batches"]
        out["native"] = native
        return out

    def close(self) -> None:
        self.fast.clear()
        self._qps.close()
        for nic in self._nics:
            nic.close()


def _no_mr(region: Region) -> TransferFailed:
    """The status of a span in a local region without an MR on every NIC (TCP serves it: the router retries)."""
    return TransferFailed(f"local region {region.region_id} has no RDMA registration")
