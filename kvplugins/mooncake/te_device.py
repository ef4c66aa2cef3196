"""Device memory in Mooncake's Transfer Engine API (issue #36): ``register_memory`` of a CUDA pointer (vLLM's
MooncakeConnector and SGLang's P/D register their device KV caches), staged through host memory.

What a peer does to our device buffer, the owner's TCP server stages (kvplugins/transfer/device.py). What this
process moves from or into its own device buffers goes through one registered host buffer here: a write copies
the device bytes to it, then sends from it; a read lands in it, then copies to the device. A batch is moved in
pieces of at most CHUNK device bytes (longer buffers split), so the host buffer stays CHUNK bytes whatever the
batch. Mooncake's TCP transport stages the same way (cudaMemcpy around each slice); its RDMA transport uses
GPUDirect, which this build has not (no dmabuf MR yet: docs/transfer.md).

Lifecycle: ``DeviceBuffers(core)`` -> ``add(region)`` per device registration -> ``run(...)`` per transfer
naming one -> ``remove(addr)`` -> ``close()``. Thread-safe (one host buffer: staged transfers take turns).
"""

from __future__ import annotations

import bisect
import threading
from typing import Callable

from kvplugins.transfer import device
from kvplugins.transfer.api import Region
from kvplugins.transfer.staging import StagingPool

CHUNK = 32 << 20  # device bytes staged at once (bytes)

# transfer(local addresses, peer addresses, lengths) -> 0 or -1: one sync batch of host memory
Transfer = Callable[[list[int], list[int], list[int]], int]


class DeviceBuffers:
    """The device buffers registered through this TransferEngine, and the host buffer staging them."""

    def __init__(self, core, chunk: int = CHUNK):
        self._core, self._chunk = core, chunk
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._regions: list[Region] = []
        self._pool: StagingPool | None = None
        self.staged_bytes = 0  # copied between device and host memory by this process's own transfers

    def any(self) -> bool:
        """Whether a device buffer is registered."""
        return bool(self._starts)

    def add(self, region: Region) -> None:
        with self._lock:
            i = bisect.bisect(self._starts, region.addr)
            self._starts.insert(i, region.addr)
            self._regions.insert(i, region)

    def remove(self, addr: int) -> Region | None:
        """The device region registered at ``addr`` (its start), now forgotten; None when there is none."""
        with self._lock:
            i = bisect.bisect_left(self._starts, addr)
            if i == len(self._starts) or self._starts[i] != addr:
                return None
            del self._starts[i]
            return self._regions.pop(i)

    def find(self, addr: int, length: int) -> Region | None:
        """The device region holding [addr, addr + length), or None. Raises ValueError for a span that starts in
        one and runs past its end."""
        with self._lock:
            i = bisect.bisect(self._starts, addr) - 1
            region = self._regions[i] if i >= 0 else None
        if region is None or addr >= region.addr + region.length:
            return None
        if addr + length > region.addr + region.length:
            raise ValueError(
                f"{addr:#x} + {length} bytes runs past the end of the device buffer at {region.addr:#x} "
                f"({region.length} bytes)"
            )
        return region

    def which(self, buffers, lengths) -> list[Region | None] | None:
        """Per buffer, its device region or None; None for a batch without device memory (the usual case, one
        check). Raises ValueError as find does."""
        if not self._starts:
            return None
        found = [self.find(int(b), int(n)) for b, n in zip(buffers, lengths)]
        return found if any(r is not None for r in found) else None

    def run(self, write: bool, buffers, peer_addrs, lengths, regions: list, transfer: Transfer) -> int:
        """Move the batch with its device buffers (``regions[i]`` not None) staged: 0, or -1 (a copy failed,
        logged by the caller's TransferFailed handling, or ``transfer`` answered -1) after which the pieces
        not yet moved are not moved."""
        for piece in self._pieces(buffers, peer_addrs, lengths, regions):
            if self._staged(write, piece, transfer) != 0:
                return -1
        return 0

    def _pieces(self, buffers, peer_addrs, lengths, regions):
        """Groups of (local, peer, length, device region or None) with at most ``chunk`` device bytes each."""
        group: list[tuple[int, int, int, Region | None]] = []
        dev_bytes = 0
        for b, p, n, r in zip(buffers, peer_addrs, lengths, regions):
            b, p, n = int(b), int(p), int(n)
            step = n if r is None else max(1, self._chunk)
            for off in range(0, max(n, 1), step):
                k = min(step, n - off)
                if r is not None and dev_bytes + k > self._chunk and group:
                    yield group
                    group, dev_bytes = [], 0
                group.append((b + off, p + off, k, r))
                dev_bytes += k if r is not None else 0
        if group:
            yield group

    def _staged(self, write: bool, piece, transfer: Transfer) -> int:
        need = sum(n for _, _, n, r in piece if r is not None)
        with self._lock:
            if self._pool is None:
                self._pool = StagingPool.registered(self._core, min(need, self._chunk))
            pool = self._pool
        with pool.slot(nbytes=need) as slot:
            local, at = [], slot.addr
            for b, _, n, r in piece:
                if r is None:
                    local.append(b)
                    continue
                if write:
                    device.copy(r.device, at, b, n, device.DEVICE_TO_HOST)
                local.append(at)
                at += n
            rc = transfer(local, [p for _, p, _, _ in piece], [n for _, _, n, _ in piece])
            if rc == 0 and not write:
                for (b, _, n, r), host in zip(piece, local):
                    if r is not None:
                        device.copy(r.device, b, host, n, device.HOST_TO_DEVICE)
            if rc == 0:
                self.staged_bytes += need
        return rc

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
