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
  3. ``transfer``                per peer: entries coalesced, cut at ``rdma_max_wr``, striped over the healthy NIC
                                 paths by measured throughput, spread over ``rdma_qps_per_peer`` QPs per path,
                                 posted as chains of one-sided work requests with selective signalling and
                                 completed in one native call (rdma_verbs.run). Chunks of a failed path are retried once on another
                                 path; what still fails is TransferFailed, which the router retries on TCP.
                                 A dead QP is rebuilt, and a down path probed back, by a background thread
                                 every ``rdma_probe_ms`` (the queue pairs and their set-up: rdma_qps.py).
  4. ``remove_region``, ``close``.
A batch mutates only its entries' destination bytes. ``endpoint``, ``reaches`` and ``stats`` are always safe.
Device memory (a CUDA tensor) cannot be registered yet: TransferEngine.register refuses it (memory.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from kvplugins.errors import TransferError, TransferFailed
from kvplugins.transfer import rdma_verbs as verbs
from kvplugins.transfer.api import Region, RegionInfo, SegmentDescriptor
from kvplugins.transfer.config import TransferConfig
from kvplugins.transfer.nics import discover
from kvplugins.transfer.rdma_paths import Path, PathStats, numa_of, pair, stripe
from kvplugins.transfer.rdma_qps import QpPool
from kvplugins.transfer.transport import Deadline, Entry, Op, Transport

log = logging.getLogger("kvplugins.transfer.rdma")


@dataclass(frozen=True)
class _Piece:
    """Coalesced entries ``first..last`` (inclusive): ``length`` bytes at local addr <-> remote addr."""

    first: int
    last: int
    laddr: int
    region_id: int
    raddr: int
    rkeys: tuple[int, ...]
    length: int


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
        the region is not RDMA-registered at all (the others are undone): TCP serves it, with a warning."""
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

    def region_info(self, region: Region, info: RegionInfo) -> RegionInfo:
        with self._lock:
            entry = self._keys.get(region.region_id)
        if entry is None:
            return info
        return replace(info, rdma=(region.addr, tuple(mr.rkey for mr in entry[1])))

    def remove_region(self, region: Region) -> None:
        with self._lock:
            entry = self._keys.pop(region.region_id, None)
            self._numa.pop(region.region_id, None)
        if entry is not None:
            for nic in self._nics:
                nic.deregister(region.addr, region.length, entry[0])

    @staticmethod
    def _access(region: Region) -> int:
        if region.readonly:
            return verbs.ACCESS_REMOTE_READ if region.exported else 0
        remote = verbs.ACCESS_REMOTE_READ | verbs.ACCESS_REMOTE_WRITE if region.exported else 0
        return verbs.ACCESS_LOCAL_WRITE | remote

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
            pieces = self._pieces(entries, idxs, status)
            failed, why = self._run(op, seg, pieces, deadline)
            if failed:
                err = TransferFailed(f"rdma to {seg}: {why}")
                for p in failed:
                    for i in range(p.first, p.last + 1):
                        status[idxs[i]] = status[idxs[i]] or err
        return status

    def _pieces(self, entries: list[Entry], idxs: list[int], status: list) -> list[_Piece]:
        """Coalesced pieces of one peer's entries, cut at rdma_max_wr (first/last index into ``idxs``)."""
        out: list[_Piece] = []
        for k, i in enumerate(idxs):
            e = entries[i]
            if e.local.region_id not in self._keys:
                status[i] = TransferFailed(f"local region {e.local.region_id} has no RDMA registration")
                continue
            raddr = e.remote_region.rdma[0] + e.remote_offset
            last = out[-1] if out else None
            if (
                last
                and last.last == k - 1
                and last.region_id == e.local.region_id
                and last.laddr + last.length == e.local_addr
                and last.raddr + last.length == raddr
                and last.rkeys == e.remote_region.rdma[1]
            ):
                out[-1] = replace(last, last=k, length=last.length + e.length)
            else:
                out.append(_Piece(k, k, e.local_addr, e.local.region_id, raddr, e.remote_region.rdma[1], e.length))
        cut, limit = [], int(self._cfg.rdma_max_wr)
        for p in out:
            if p.length <= limit:
                cut.append(p)
                continue
            for off in range(0, p.length, limit):
                cut.append(replace(p, laddr=p.laddr + off, raddr=p.raddr + off, length=min(limit, p.length - off)))
        return cut

    def _run(self, op: Op, seg: str, pieces: list[_Piece], deadline: Deadline) -> tuple[list[_Piece], str]:
        """Run ``pieces`` to peer ``seg`` over its healthy paths; a failed path's pieces get one more round on
        the others. Returns (pieces that failed, why)."""
        todo, why, tried = pieces, "no healthy RDMA path", set()
        while todo:
            paths = [p for p in self._live_paths(seg, pieces) if p not in tried]
            if not paths:
                return todo, why
            todo, why, bad = self._round(op, seg, todo, paths, deadline)
            tried |= bad
            if not bad:
                return todo, why
        return [], ""

    def _live_paths(self, seg: str, pieces: list[_Piece]) -> list[Path]:
        ep, up = self._qps.endpoint(seg), self._qps.nics_up
        paths = [p for p in (self._paths(ep) if ep else []) if up[p.local] and self._stats.up((seg, p.local, p.remote))]
        regions = {p.region_id for p in pieces}
        near = [
            p for p in paths if all(self._numa.get(r, -1) in (-1, self._nics[p.local].info.numa_node) for r in regions)
        ]
        return near or paths

    def _round(self, op: Op, seg: str, pieces: list[_Piece], paths: list[Path], deadline: Deadline):
        """One striped attempt; returns (failed pieces, why, failed paths)."""
        owner = self._stripe(seg, pieces, paths)
        works, failed, why, bad = [], [], "", set()
        held: list[tuple[tuple, verbs.QueuePair]] = []
        for k, path in enumerate(paths):
            mine = [p for p, o in zip(pieces, owner) if o == k]
            if not mine:
                continue
            qps, err = self._qps.acquire(seg, path, len(mine), deadline)
            if not qps:
                failed += mine
                why = err
                bad.add(path)
                continue
            held += [((seg, path), q) for q in qps]
            for j, q in enumerate(qps):
                works.append(
                    (path, verbs.Work(q, [self._chunk(p, path) for p in mine[j :: len(qps)]]), mine[j :: len(qps)])
                )
        start = time.monotonic()
        posted = verbs.run(op is Op.READ, [w for _, w, _ in works], deadline.at, self._cfg.rdma_signal_every)
        self._stats.add("wrs", posted)
        self._stats.add("striped_batches", int(len({id(p) for p, _, _ in works}) > 1))
        failed, why, bad = self._settle(seg, works, start, failed, why, bad)
        self._qps.release(held)
        return failed, why, bad

    def _stripe(self, seg: str, pieces: list[_Piece], paths: list[Path]) -> list[int]:
        """Path index per piece: by measured throughput (rdma_paths.stripe); a small batch takes the best path."""
        if len(paths) == 1:
            return [0] * len(pieces)
        speeds = [self._nics[p.local].info.speed_gbps or 1.0 for p in paths]
        weights = [self._stats.weight((seg, p.local, p.remote), s * 125e6) for p, s in zip(paths, speeds)]
        if sum(p.length for p in pieces) <= self._cfg.rdma_max_wr:
            weights = [w if w == max(weights) else 0.0 for w in weights]
        return stripe([p.length for p in pieces], weights)

    def _settle(self, seg, works, start, failed, why, bad):
        """Telemetry and failures of a round's works (failed chunks map back to their pieces)."""
        moved: dict[Path, list] = {}
        for path, w, mine in works:
            acc = moved.setdefault(path, [0, start])
            acc[0] += sum(c.length for c in w.chunks[: w.done])
            acc[1] = max(acc[1], w.finished_at or time.monotonic())
            if w.error:
                done = {id(c) for c in w.chunks[: w.done]}
                failed += [p for p, c in zip(mine, w.chunks) if id(c) not in done]
                why = f"{self._nics[path.local].info.name}: {w.error}"
                if path not in bad:
                    bad.add(path)
                    self._stats.failed((seg, path.local, path.remote))
                    log.warning(
                        "rdma path %s -> %s of %s failed (%s); retrying its work on another path",
                        self._nics[path.local].info.name,
                        path.remote,
                        seg,
                        w.error,
                    )
        for path, (nbytes, end) in moved.items():
            self._stats.sample(
                (seg, path.local, path.remote),
                f"{self._nics[path.local].info.name}->{path.remote}",
                nbytes,
                end - start,
            )
        return failed, why, bad

    def _chunk(self, p: _Piece, path: Path) -> verbs.Chunk:
        mr = self._keys[p.region_id][1][path.local]
        return verbs.Chunk(p.laddr, mr.lkey, p.raddr, p.rkeys[path.remote], p.length)

    def stats(self) -> dict[str, Any]:
        """wrs posted, path_failures, qp_rebuilds, striped_batches, path_mbps (measured MB/s per peer and path),
        path_bytes (per local NIC -> peer NIC index), paths_down, qps (ours), qps_served (for peers), nics_up."""
        return {**self._stats.snapshot(), **self._qps.stats()}

    def close(self) -> None:
        self._qps.close()
        for nic in self._nics:
            nic.close()
