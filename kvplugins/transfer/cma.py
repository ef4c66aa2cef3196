"""Cross-memory-attach transport (same host): copy straight between this process and a peer's exported memory
with Linux ``process_vm_readv`` / ``process_vm_writev``, so no thread of the peer runs for a transfer.

It reaches memory the shm transport cannot: a peer's ordinary registered memory (vLLM's KV tensors, a plain
numpy array), which has no shared-memory file to hand over. The peer publishes its pid and the process's start
time (``/proc/<pid>/stat`` field 22) in its endpoint, and each exported region's address (``RegionInfo.addr``);
a batch checks the start time before it copies and the peer's pidfd after (peers.py, shared with shm.py), so a pid reused by another process
never moves a byte and a peer that died mid-batch fails the batch (TransferFailed). The kernel checks the rest:
the same user (or CAP_SYS_PTRACE) and a ptrace policy that allows it (Yama ``ptrace_scope`` 0); an EPERM marks
the peer unreachable for this transport (one warning), and the router falls back to the next one (rdma, tcp).
Contract beyond the other transports': a peer keeps an exported region's memory allocated until peers stop
using its descriptor (as with RDMA MRs; the P/D handover checks its lease word after a read for this reason).

One system call per 1024 spans (IOV_MAX), the iovec arrays built with numpy; ctypes releases the GIL.
Source followed: process_vm_readv(2); the CMA path of UCX and Open MPI's ``smsc/cma`` (read, not copied).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import threading
from dataclasses import replace
from typing import Any

import numpy as np

from kvplugins.errors import OutOfRange, TransferError, TransferFailed
from kvplugins.transfer.api import Region, RegionInfo, SegmentDescriptor
from kvplugins.transfer.cma_fast import FastRoutes
from kvplugins.transfer.peers import PeerWatch, start_time
from kvplugins.transfer.spans import SpanBatch
from kvplugins.transfer.transport import Deadline, Entry, Op, Transport

log = logging.getLogger("kvplugins.transfer")
IOV_MAX = 1024


@functools.cache
def _calls() -> tuple[Any, Any] | None:
    """(process_vm_readv, process_vm_writev) from libc, or None where this is not Linux."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fns = libc.process_vm_readv, libc.process_vm_writev
    except (OSError, AttributeError):
        return None
    for fn in fns:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fns


def available() -> bool:
    """Whether this kernel and libc offer process_vm_readv (Linux >= 3.2)."""
    return _calls() is not None


def self_check() -> str | None:
    """Copy 8 bytes of this process's memory with process_vm_readv: None when it works, else why (e.g. a
    seccomp profile that refuses the call)."""
    calls = _calls()
    if calls is None:
        return "process_vm_readv is not available on this system"
    src, dst = np.arange(1, 9, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
    liov = _iovecs(np.array([dst.ctypes.data], np.uint64), np.array([8], np.uint64))
    riov = _iovecs(np.array([src.ctypes.data], np.uint64), np.array([8], np.uint64))
    got = calls[0](os.getpid(), liov.ctypes.data, 1, riov.ctypes.data, 1, 0)
    if got != 8 or not (dst == src).all():
        return f"process_vm_readv failed: {os.strerror(ctypes.get_errno()) if got < 0 else f'{got} of 8 bytes'}"
    return None


def ptrace_scope() -> int | None:
    """Yama's kernel.yama.ptrace_scope (0: any process of the same user; 1: descendants only; 2: admin only;
    3: none), or None where Yama is absent (the same-user rule alone)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class CmaTransport(Transport):
    """Offers {"pid": ..., "start": ...}; reaches an exported region of a peer with our host_id whose descriptor
    gives the region's address, unless the kernel refused this peer before."""

    name = "cma"

    def __init__(self, host_id: str):
        self._host_id = host_id
        self._pid = os.getpid()
        self._start = start_time(self._pid)
        self._lock = threading.Lock()
        self._denied: dict[str, str] = {}  # segment -> why the kernel refused it
        self._peers = PeerWatch(self.name)
        self.fast = FastRoutes()  # small batches in one native call (cma_fast.py)

    def endpoint(self) -> dict[str, Any]:
        return {"pid": self._pid, "start": self._start}

    def region_info(self, region: Region, info: RegionInfo) -> RegionInfo:
        return info if region.device is not None else replace(info, addr=region.addr)

    def reaches(self, remote: SegmentDescriptor, region: RegionInfo) -> bool:
        ep = remote.transports.get("cma")
        return (
            remote.host_id == self._host_id
            and isinstance(region.addr, int)
            and isinstance(ep, dict)
            and type(ep.get("pid")) is int
            and ep["pid"] > 0
            and type(ep.get("start")) is int
            and remote.segment_id not in self._denied
        )

    def transfer(self, op: Op, entries: list[Entry], deadline: Deadline) -> list[TransferError | None]:
        status: list[TransferError | None] = [None] * len(entries)
        by_peer: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            by_peer.setdefault(e.remote.segment_id, []).append(i)
        for idxs in by_peer.values():
            first = entries[idxs[0]]
            local = np.array([entries[i].local_addr for i in idxs], dtype=np.uint64)
            remote = np.array([entries[i].remote_region.addr + entries[i].remote_offset for i in idxs], np.uint64)
            lens = np.array([entries[i].length for i in idxs], dtype=np.uint64)
            err = self._copy(op, first.remote, local, remote, lens)
            for i in idxs:
                status[i] = err
        return status

    def transfer_spans(self, op: Op, batch: SpanBatch, deadline: Deadline) -> list[TransferError | None] | None:
        """The whole span batch to one remote region: one system call per IOV_MAX spans."""
        base = batch.info.addr
        if base is None:
            return [OutOfRange(f"region {batch.info.region_id} of {batch.remote.segment_id} has no address")] * len(
                batch
            )
        local = np.asarray(batch.addrs, dtype=np.uint64)
        remote = np.asarray(batch.roffs, dtype=np.uint64) + np.uint64(base)
        err = self._copy(op, batch.remote, local, remote, np.asarray(batch.lens, dtype=np.uint64))
        return None if err is None else [err] * len(batch)

    def _copy(
        self, op: Op, peer: SegmentDescriptor, local: np.ndarray, remote: np.ndarray, lens: np.ndarray
    ) -> TransferError | None:
        """Every span between local and the peer's memory; None, or the TransferFailed of the whole group."""
        ep = peer.transports["cma"]
        pid = ep["pid"] if isinstance(ep["pid"], int) else 0  # reaches() checked it is an int
        try:
            self._peers.check(peer.segment_id, pid, ep["start"])
        except TransferFailed as e:
            return e
        calls = _calls()
        if calls is None:
            return TransferFailed("process_vm_readv is not available on this system")
        fn = calls[0] if op is Op.READ else calls[1]
        for lo in range(0, len(lens), IOV_MAX):
            hi = min(lo + IOV_MAX, len(lens))
            liov, riov = _iovecs(local[lo:hi], lens[lo:hi]), _iovecs(remote[lo:hi], lens[lo:hi])
            want = int(lens[lo:hi].sum())
            got = fn(pid, liov.ctypes.data, hi - lo, riov.ctypes.data, hi - lo, 0)
            if got != want:
                return self._failed(peer, pid, got, want, ctypes.get_errno())
        return self._peers.exited(peer.segment_id, pid)

    def _failed(self, peer: SegmentDescriptor, pid: int, got: int, want: int, err: int) -> TransferFailed:
        if got >= 0:
            return TransferFailed(
                f"cma peer {peer.segment_id} (pid {pid}): short copy, {got} of {want} bytes "
                "(a region smaller than its descriptor says?)"
            )
        why = f"{os.strerror(err)} (errno {errno.errorcode.get(err, err)})"
        if err == errno.EPERM:
            with self._lock:
                self._denied[peer.segment_id] = why
            log.warning(
                "cma: the kernel refuses access to pid %d (%s: another user, or Yama ptrace_scope > 0); "
                "its segment %s is reached by the next transport",
                pid,
                why,
                peer.segment_id,
            )
        return TransferFailed(f"cma peer {peer.segment_id} (pid {pid}): {why}")

    def add_region(self, region: Region) -> None:
        if region.device is None:
            self.fast.add_local(region)

    def remove_region(self, region: Region) -> None:
        self.fast.drop_local(region.region_id)  # waits for its fast batches in flight

    def first_choice(self, remote: SegmentDescriptor, info: RegionInfo) -> None:
        """The next small batch to region ``info`` of ``remote`` runs in one native call (cma_fast.py), once this
        transport watches the peer through a pidfd (none on kernels without pidfd_open: no route)."""
        pidfd = self._peers.pidfd(remote.segment_id)
        if pidfd >= 0:
            self.fast.put(remote, info, remote.transports["cma"]["pid"], pidfd)

    def fast_failed(self, seg: str) -> None:
        """A native fast batch to peer ``seg`` failed (a short copy, an error, the peer exited): forget the peer's
        routes; the caller runs the batch its general way, which names the error."""
        self.fast.drop(seg)

    def stats(self) -> dict[str, Any]:
        """ "denied_peers" where the kernel refused some; "native": the small batches done from the engine's entry
        (cma_fast.py counts; the router adds them to this transport's)."""
        with self._lock:
            out: dict[str, Any] = {"denied_peers": len(self._denied)} if self._denied else {}
        return {**out, "native": self.fast.counts()}

    def close(self) -> None:
        self.fast.clear()
        self._peers.close()


def _iovecs(addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """struct iovec[] (void *base, size_t len; 16 bytes each on 64-bit Linux) as an (n, 2) uint64 array."""
    iov = np.empty((len(lens), 2), dtype=np.uint64)
    iov[:, 0], iov[:, 1] = addrs, lens
    return iov
