"""Mooncake 0.3.13's Python Transfer Engine (``mooncake.engine.TransferEngine``) over kvplugins.transfer.

Lifecycle, in call order (as Mooncake's):
  1. ``TransferEngine()``, then ``initialize(local_hostname, "P2PHANDSHAKE", protocol, device_name)``: starts one
     kvplugins TransferEngine whose TCP server is the handshake port (``get_rpc_port()``); peers name this
     process ``host:port``. With an etcd metadata server (``"etcd://host:port"``, or ``"host:port"`` as Mooncake
     reads it) the segment is named ``local_hostname`` (any string; its server binds that address when it is an
     IP address, else the transfer config's host, KVPLUGINS_TRANSFER_HOST) and peers find the server in etcd
     (te_names.py; the name is held while this process lives); with an HTTP metadata server
     (``"http://host:port/metadata"``) likewise, under Mooncake's own key. Transports: the transfer config's (default shm, cma, rdma, tcp; rdma dropped, with one
     log line, where this host has none), less rdma for protocol "tcp"; ``device_name``: the RDMA devices.
  2. ``register_memory(address, bytes, location)`` / ``batch_register_memory``, or
     ``allocate_managed_buffer(bytes)``: memory peers may read and write (exported), and local buffers of
     transfers (every local buffer must be registered, on every transport). Device memory (``location``
     "cuda:N", or "*" for a CUDA pointer) is staged through host memory (te_device.py): peers reach it over TCP.
  3. Transfers to a peer segment ``host:port``, at addresses in the peer's registered buffers: ``transfer_sync_*``,
     ``batch_transfer_sync_*`` (0 done, -1 failed), ``batch_transfer_async_*`` (a batch id, 0 when not submitted)
     then ``get_batch_transfer_status([ids])`` (0 / -1), ``transfer_submit_write`` (id or -1) then
     ``transfer_check_status(id)`` (1 done, 0 running, -1 failed). ``notify``: after the transfer, the peer's
     ``get_notifies()`` returns (name, msg).
  4. ``unregister_memory`` / ``free_managed_buffer``; the engine closes at exit (or ``close()``).

Integer codes are Mooncake's, as in the store's compatibility layer (codes.py is that layer's one place for
them). What differs (docs/transfer.md): the P2PHANDSHAKE, etcd and HTTP metadata modes only (no Redis), every
connection authenticated with the cluster secret, local buffers must be registered on TCP too, the TENT
transport hints are accepted and ignored (the router picks the fastest transport both sides offer),
``get_engine``/``get_engine_ptr`` (a C++ engine object) and the CUDA-stream methods do not exist.
Source followed: mooncake-integration/transfer_engine/transfer_engine_py.cpp (0.3.13), read, not copied.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import itertools
import json
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

import numpy as np

from kvplugins.errors import BufferNotRegistered, ConfigError, KVPluginsError, TransferFailed
from kvplugins.mooncake.te_device import DeviceBuffers
from kvplugins.mooncake.te_names import EtcdNames, HttpNames
from kvplugins.mooncake.te_peers import Segments
from kvplugins.transfer import TransferEngine as CoreEngine
from kvplugins.transfer import TransferRequest, device
from kvplugins.transfer.config import transfer_config
from kvplugins.transfer.spans import SMALL

log = logging.getLogger("kvplugins.mooncake.te")
P2PHANDSHAKE = "P2PHANDSHAKE"
BYTES_PER_MS = 1 << 20  # a batch's timeout grows by 1 ms per MiB (Mooncake: 1 ns per byte, ~1 GiB/s)


class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1


Read, Write = TransferOpcode.Read, TransferOpcode.Write


@dataclass
class TransferNotify:
    """A message for the peer of a transfer: ``name`` (who), ``msg``."""

    name: str = ""
    msg: str = ""


class TransferEngine:
    """``mooncake.engine.TransferEngine`` (module docstring: lifecycle, codes, differences). Thread-safe."""

    def __init__(self) -> None:
        self._core: CoreEngine | None = None
        self._segments: Segments | None = None
        self._managed: dict[int, object] = {}  # managed buffer address -> its Region
        self._batches: dict[int, tuple[Future, float, str]] = {}  # batch id -> (statuses, deadline, peer)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._names: EtcdNames | HttpNames | None = None  # etcd / HTTP metadata: this segment's name, lookups
        self._device: DeviceBuffers | None = None  # device buffers registered here, staged through host memory

    # -- set-up ---------------------------------------------------------------------------------------------
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    def initialize_ext(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, metadata_type: str
    ) -> int:
        if self._core is not None:
            log.error("initialize: this TransferEngine is initialized already")
            return -1
        try:
            names = _names(metadata_server, metadata_type)
        except KVPluginsError as e:
            log.error("initialize: %s", e)
            return -1
        if protocol not in ("tcp", "rdma"):
            log.error("initialize: protocol %r: use tcp or rdma (NVLink, EFA, HIP are not served)", protocol)
            return -1
        host = local_hostname.rpartition(":")[0] if local_hostname.count(":") == 1 else local_hostname
        if names is not None and not _is_ip(host):  # a free name: bind the transfer config's host
            host = ""
        elif not host:
            host = "127.0.0.1"
        try:
            cfg = transfer_config(host=host, rdma_devices=device_name or "")
            if protocol == "tcp":  # the configured transports (KVPLUGINS_TRANSFER_TRANSPORTS, [transfer]) less rdma
                cfg = replace(cfg, transports=",".join(t for t in cfg.transports.split(",") if t.strip() != "rdma"))
            core = CoreEngine(cfg)
        except (KVPluginsError, OSError) as e:
            log.error("initialize(%r, %r): %s", local_hostname, protocol, e)
            return -1
        if names is not None:
            try:
                port = int(core.descriptor().transports["tcp"]["port"])  # type: ignore[arg-type]
                names.publish(local_hostname, core.config.host, port)
            except (KVPluginsError, OSError) as e:
                log.error("initialize(%r, %r): %s", local_hostname, metadata_server, e)
                core.close()
                return -1
        self._names = names
        self._segments = Segments(core, core.config.timeout_ms, names.lookup if names is not None else None)
        self._device = DeviceBuffers(core)
        self._core = core
        return 0

    def get_rpc_port(self) -> int:
        core = self._ready("get_rpc_port")
        return int(core.descriptor().transports["tcp"]["port"]) if core is not None else -1  # type: ignore[arg-type]

    def get_local_topology(self, device_name: str | None = None) -> str:
        """JSON of this host's transports and RDMA devices (Mooncake: its NIC topology matrix)."""
        core = self._core or CoreEngine(transfer_config(host="127.0.0.1"))
        try:
            transports = core.descriptor().transports
            return json.dumps({"transports": list(transports), "rdma": transports.get("rdma", {})})
        finally:
            if core is not self._core:
                core.close()

    # -- memory -----------------------------------------------------------------------------------------------
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Export ``capacity`` bytes at ``buffer_addr``: host memory, or device memory where ``location`` is
        "cuda:N" or "*" finds a CUDA pointer (kvplugins/transfer/device.py: staged through host memory)."""
        core = self._ready("register_memory")
        if core is None:
            return -1
        try:
            dev = device.for_location(location, int(buffer_addr), core.config.device_emulation)
            region = core.register(int(buffer_addr), int(capacity), export=True, device=dev)
        except (KVPluginsError, TypeError, ValueError) as e:
            log.error("register_memory(%#x, %d, %r): %s", buffer_addr, capacity, location, e)
            return -1
        if dev is not None:
            if not self._device.any():  # type: ignore[union-attr]
                log.warning(  # once per engine: what an operator of a GPU host should know about speed
                    "register_memory: %s device memory is staged through host memory and reached over TCP (no "
                    "GPUDirect RDMA in this build): transfers run at host copy speed",
                    dev.kind,
                )
            self._device.add(region)  # type: ignore[union-attr]
        self._segments.add(region.addr, region.length, region.region_id)  # type: ignore[union-attr]
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        core = self._ready("unregister_memory")
        if core is None:
            return -1
        dev = self._device.remove(int(buffer_addr))  # type: ignore[union-attr]
        if dev is not None:
            core.unregister(dev)
            self._segments.remove(dev.addr)  # type: ignore[union-attr]
            return 0
        try:
            region = core.region_for(int(buffer_addr), 1)
            if region.addr != buffer_addr:
                raise KVPluginsError(f"{buffer_addr:#x} is inside the buffer at {region.addr:#x}, not its start")
            core.unregister(region)
        except KVPluginsError as e:
            log.error("unregister_memory(%#x): %s", buffer_addr, e)
            return -1
        self._segments.remove(region.addr)  # type: ignore[union-attr]
        return 0

    def batch_register_memory(self, buffer_addresses: list[int], capacities: list[int], location: str = "*") -> int:
        if len(buffer_addresses) != len(capacities):
            log.error("batch_register_memory: %d addresses, %d capacities", len(buffer_addresses), len(capacities))
            return -1
        return min((self.register_memory(a, n, location) for a, n in zip(buffer_addresses, capacities)), default=0)

    def batch_unregister_memory(self, buffer_addresses: list[int]) -> int:
        return min((self.unregister_memory(a) for a in buffer_addresses), default=0)

    def allocate_managed_buffer(self, length: int) -> int:
        """A registered, exported buffer of ``length`` bytes (shared memory: same-host peers copy it directly);
        its address, 0 on failure."""
        core = self._ready("allocate_managed_buffer")
        try:
            region = core.alloc_shared(int(length)) if core is not None else None
        except (KVPluginsError, OSError) as e:
            log.error("allocate_managed_buffer(%d): %s", length, e)
            region = None
        if region is None:
            return 0
        with self._lock:
            self._managed[region.addr] = region
        self._segments.add(region.addr, region.length, region.region_id)  # type: ignore[union-attr]
        return region.addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        with self._lock:
            region = self._managed.pop(int(buffer_addr), None)
        if region is None or self._core is None:
            log.error("free_managed_buffer(%#x): not a managed buffer of this engine", buffer_addr)
            return -1
        self._segments.remove(int(buffer_addr))  # type: ignore[union-attr]
        self._core.unregister(region)  # type: ignore[arg-type]
        return 0

    def write_bytes_to_buffer(self, buffer_addr: int, data: bytes, length: int) -> int:
        """Copy ``length`` bytes of ``data`` to ``buffer_addr``, which must lie in registered memory."""
        if not self._registered("write_bytes_to_buffer", buffer_addr, length) or length > len(data):
            return -1
        ctypes.memmove(buffer_addr, data, length)
        return 0

    def read_bytes_from_buffer(self, buffer_addr: int, length: int) -> bytes:
        """``length`` bytes at ``buffer_addr`` (in registered memory). Raises ValueError elsewhere."""
        if not self._registered("read_bytes_from_buffer", buffer_addr, length):
            raise ValueError(f"read_bytes_from_buffer({buffer_addr:#x}, {length}): not inside registered memory")
        return ctypes.string_at(buffer_addr, length)

    # -- transfers --------------------------------------------------------------------------------------------
    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length, transport_hint="") -> int:
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], Read)

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint="") -> int:
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], Write)

    def transfer_sync(
        self, target_hostname, buffer, peer_buffer_address, length, opcode, notify=None, transport_hint=""
    ) -> int:
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses, lengths, Read)

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses, lengths, Write)

    def batch_transfer_sync(
        self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify=None, transport_hint=""
    ) -> int:
        staged = self._staged(target_hostname, buffers, peer_buffer_addresses, lengths, TransferOpcode(opcode))
        if staged is not None:  # device buffers: moved in host pieces; the notify follows the whole batch
            return staged if staged != 0 or notify is None else self._notify(target_hostname, notify)
        if len(lengths) > SMALL:  # many buffers: the core's array form, per peer region
            statuses = self._run_spans(target_hostname, buffers, peer_buffer_addresses, lengths, TransferOpcode(opcode))
            if statuses is None:
                return -1
        else:
            statuses = self._run_few(target_hostname, buffers, peer_buffer_addresses, lengths, TransferOpcode(opcode))
            if statuses is None:
                return -1
        if not _ok("batch_transfer_sync", target_hostname, statuses):
            self._segments.forget(target_hostname)  # type: ignore[union-attr]
            return -1
        return 0 if notify is None else self._notify(target_hostname, notify)

    def _notify(self, target_hostname: str, notify: TransferNotify) -> int:
        try:
            self._segments.notify(target_hostname, notify.name, notify.msg)  # type: ignore[union-attr]
        except (KVPluginsError, ValueError) as e:
            log.error("notify of %s failed: %s", target_hostname, e)
            return -1
        return 0

    def _staged(self, name, buffers, peer_addrs, lengths, opcode: TransferOpcode) -> int | None:
        """None when no local buffer is device memory (nothing done); else the batch moved through host memory
        (te_device.py): 0, or -1 (logged)."""
        dev = self._device
        try:
            regions = dev.which(buffers, lengths) if dev is not None and len(buffers) == len(lengths) else None
            if regions is None:
                return None
            return dev.run(  # type: ignore[union-attr]
                opcode == Write, buffers, peer_addrs, lengths, regions,
                lambda b, p, n: self.batch_transfer_sync(name, b, p, n, opcode),
            )  # fmt: skip
        except (KVPluginsError, ValueError, TypeError) as e:
            log.error("transfer to %r with device buffers: %s", name, e)
            return -1

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, Read)

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, Write)

    def batch_transfer_async(
        self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint=""
    ) -> int:
        """A batch id (> 0) for get_batch_transfer_status, 0 when nothing was submitted. A batch with device
        buffers is moved before this returns (staged), its id then answering at once."""
        op = TransferOpcode(opcode)
        staged = self._staged(target_hostname, buffers, peer_buffer_addresses, lengths, op)
        if staged is not None:
            return self._finished(target_hostname, staged)
        reqs = self._requests("batch_transfer_async", target_hostname, buffers, peer_buffer_addresses, lengths)
        return 0 if reqs is None else max(0, self._submit(target_hostname, reqs, op, lengths))

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint="") -> int:
        staged = self._staged(target_hostname, [buffer], [peer_buffer_address], [length], Write)
        if staged is not None:
            return self._finished(target_hostname, staged)
        reqs = self._requests("transfer_submit_write", target_hostname, [buffer], [peer_buffer_address], [length])
        return -1 if reqs is None else self._submit(target_hostname, reqs, Write, [length])

    def _finished(self, name: str, rc: int) -> int:
        """The id of a batch already moved (``rc`` 0) or failed."""
        fut: Future = Future()
        fut.set_result([None] if rc == 0 else [TransferFailed("the staged batch failed (logged above)")])
        with self._lock:
            batch_id = next(self._ids)
            self._batches[batch_id] = (fut, time.monotonic(), name)
        return batch_id

    def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
        """Wait for every batch of ``batch_ids``: 0 when all moved every byte, else -1 (each id is used up)."""
        with self._lock:
            got = [self._batches.pop(int(b), None) for b in batch_ids]
        ok = all(g is not None for g in got)
        for g in got:
            ok = g is not None and _done(*g) and ok
        return 0 if ok else -1

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done (the id is used up), 0 still running, -1 failed or unknown."""
        with self._lock:
            got = self._batches.get(int(batch_id))
            if got is None or not got[0].done():
                return 0 if got is not None else -1
            del self._batches[int(batch_id)]
        return 1 if _done(*got) else -1

    # -- peers ------------------------------------------------------------------------------------------------
    def get_first_buffer_address(self, segment_name: str) -> int:
        try:
            return self._segments.open(segment_name).first if self._ready("get_first_buffer_address") else 0
        except (KVPluginsError, ValueError) as e:
            log.error("get_first_buffer_address(%r): %s", segment_name, e)
            return 0

    def send_probe(self, peer_server_name: str) -> int:
        try:
            return 0 if self._ready("send_probe") and self._segments.open(peer_server_name, fresh=True) else -1
        except (KVPluginsError, ValueError) as e:
            log.error("send_probe(%r): %s", peer_server_name, e)
            return -1

    def get_notifies(self) -> list[TransferNotify]:
        """The notifies peers sent since the last call (drained)."""
        segments = self._segments
        return [TransferNotify(n, m) for n, m in segments.take_notifies()] if segments is not None else []

    def warmup_efa_segment(self, segment_name: str) -> int:
        return 0  # no EFA transport here (Mooncake answers 0 without one too)

    def stats(self) -> dict:
        """kvplugins' addition (not Mooncake's): the transfer core's counters (per transport entries and bytes;
        ``tcp.server_staged_bytes``: bytes of this engine's device buffers peers read or wrote) and
        ``device_staged_bytes`` (bytes this engine's own transfers copied between its device buffers and host
        memory). {} before initialize."""
        core, dev = self._core, self._device
        if core is None or dev is None:
            return {}
        return {**core.stats(), "device_staged_bytes": dev.staged_bytes}

    def close(self) -> None:
        """Stop the engine (Mooncake: the destructor). Idempotent."""
        core, self._core = self._core, None
        names, self._names = self._names, None
        dev, self._device = self._device, None
        if dev is not None:
            dev.close()
        if names is not None:
            names.close()
        if core is not None:
            core.close()

    # -- internals --------------------------------------------------------------------------------------------
    def _ready(self, what: str) -> CoreEngine | None:
        if self._core is None:
            log.error("%s: call initialize() first", what)
        return self._core

    def _registered(self, what: str, addr: int, length: int) -> bool:
        core = self._ready(what)
        try:
            return core is not None and length >= 0 and core.region_for(int(addr), max(1, int(length))) is not None
        except KVPluginsError as e:
            log.error("%s(%#x, %d): %s", what, addr, length, e)
            return False

    def _requests(self, what, name, buffers, peer_addrs, lengths) -> list[TransferRequest] | None:
        """The batch as TransferRequests, or None (logged) for mismatched lists, an unknown peer, an address
        outside the peer's buffers (after asking it again) or a local buffer outside registered memory."""
        if self._ready(what) is None:
            return None
        if not len(buffers) == len(peer_addrs) == len(lengths):
            log.error("%s: buffers, peer_buffer_addresses and lengths have different sizes", what)
            return None
        try:
            peer = self._segments.open(name)  # type: ignore[union-attr]
            where = [peer.locate(int(a), int(n)) for a, n in zip(peer_addrs, lengths)]
            if None in where:
                peer = self._segments.open(name, fresh=True)  # type: ignore[union-attr]
                where = [peer.locate(int(a), int(n)) for a, n in zip(peer_addrs, lengths)]
            if None in where:
                bad = where.index(None)
                raise KVPluginsError(
                    f"{peer_addrs[bad]:#x} + {lengths[bad]} bytes is not inside a buffer it registered"
                )
            reqs = []
            for buf, n, (region, off) in zip(buffers, lengths, where):  # type: ignore[misc]
                local = self._core.region_for(int(buf), max(1, int(n)))  # type: ignore[union-attr]
                reqs.append(TransferRequest(local, int(buf) - local.addr, peer.descriptor, region, off, int(n)))
            return reqs
        except (KVPluginsError, ValueError, TypeError) as e:
            log.error("%s to %r: %s", what, name, e)
            return None

    def _run_few(self, name, buffers, peer_addrs, lengths, opcode: TransferOpcode) -> list | None:
        """A sync batch of at most SMALL buffers: statuses, or None (logged, nothing moved) for what _requests
        refuses. Into one peer region it is read_spans / write_spans of int lists, which a route table runs in one
        native call (no TransferRequest per buffer); otherwise batch_read / batch_write. Every local buffer is
        checked registered first (region_for raises BufferNotRegistered), so a refused batch moves nothing."""
        what, core = "batch_transfer_sync", self._ready("batch_transfer_sync")
        if core is None:
            return None
        one = self._one_region(name, peer_addrs, lengths) if len(buffers) == len(peer_addrs) == len(lengths) else None
        try:
            if one is not None:
                for b, n in zip(buffers, lengths):
                    core.region_for(int(b), int(n))  # raises BufferNotRegistered: nothing moves
                descriptor, region, offs = one
                run = core.read_spans if opcode == Read else core.write_spans
                return run(descriptor, region, [int(b) for b in buffers], offs, [int(n) for n in lengths],
                           _timeout_ms(core, lengths))  # fmt: skip
            reqs = self._requests(what, name, buffers, peer_addrs, lengths)
            if reqs is None:
                return None
            return (core.batch_read if opcode == Read else core.batch_write)(reqs, _timeout_ms(core, lengths))
        except (BufferNotRegistered, ValueError, TypeError, OverflowError) as e:  # refused before anything moved
            log.error("%s to %r: %s", what, name, e)
            return None
        except KVPluginsError as e:  # closed meanwhile
            return [e]

    def _one_region(self, name, peer_addrs, lengths) -> tuple | None:
        """(peer descriptor, region id, offsets) when every buffer of a few lies in one region the peer registered
        (as known: an address outside them goes to _requests, which asks the peer again), else None."""
        try:
            if min(int(n) for n in lengths) <= 0:
                return None
            peer = self._segments.open(name)  # type: ignore[union-attr]
            where = [peer.locate(int(a), int(n)) for a, n in zip(peer_addrs, lengths)]
        except (KVPluginsError, ValueError, TypeError):
            return None  # _requests logs it
        if None in where or len({w[0] for w in where}) != 1:  # type: ignore[index]
            return None
        return peer.descriptor, where[0][0], [w[1] for w in where]  # type: ignore[index]

    def _run_spans(self, name, buffers, peer_addrs, lengths, opcode: TransferOpcode) -> list | None:
        """A sync batch as read_spans / write_spans per peer region: statuses, or None (logged, nothing moved) for
        what _requests refuses."""
        what = "batch_transfer_sync"
        if self._ready(what) is None:
            return None
        try:
            local, raddrs, lens = (np.asarray(c, dtype=np.uint64) for c in (buffers, peer_addrs, lengths))
            if not (local.ndim == raddrs.ndim == lens.ndim == 1 and len(local) == len(raddrs) == len(lens)):
                raise ValueError("buffers, peer_buffer_addresses and lengths have different sizes")
            peer = self._segments.open(name)  # type: ignore[union-attr]
            where = peer.locate_many(raddrs, lens)
            if where is None:
                peer = self._segments.open(name, fresh=True)  # type: ignore[union-attr]
                where = peer.locate_many(raddrs, lens)
            if where is None:
                raise KVPluginsError("a peer buffer address is not inside a buffer it registered")
            core = self._core
            unregistered = np.flatnonzero(~core.spans_registered(local, lens))  # type: ignore[union-attr]
            if len(unregistered):
                j = int(unregistered[0])
                raise KVPluginsError(f"local buffer {int(local[j]):#x} + {int(lens[j])} bytes is not registered")
        except (KVPluginsError, ValueError, TypeError, OverflowError) as e:
            log.error("%s to %r: %s", what, name, e)
            return None
        run = core.read_spans if opcode == Read else core.write_spans  # type: ignore[union-attr]
        regions, offs = where
        statuses: list = []
        try:
            for region in np.unique(regions).tolist():
                pick = regions == region
                statuses += run(
                    peer.descriptor, int(region), local[pick], offs[pick], lens[pick], _timeout_ms(core, lengths)
                )
        except KVPluginsError as e:  # closed meanwhile
            statuses.append(e)
        return statuses

    def _submit(self, name: str, reqs: list[TransferRequest], opcode: TransferOpcode, lengths) -> int:
        core = self._core
        timeout_ms = _timeout_ms(core, lengths)
        submit = core.submit_read if opcode == Read else core.submit_write  # type: ignore[union-attr]
        try:
            fut = submit(reqs, timeout_ms)
        except KVPluginsError as e:  # closed meanwhile
            log.error("submit to %r: %s", name, e)
            return -1
        with self._lock:
            batch_id = next(self._ids)
            self._batches[batch_id] = (fut, time.monotonic() + timeout_ms / 1000 + 1, name)
        return batch_id


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def _names(server: str, metadata_type: str) -> EtcdNames | HttpNames | None:
    """Where segment names live: None for P2PHANDSHAKE (peers named host:port); etcd for ``etcd://host:port[,...]``,
    a scheme-less ``host:port`` (as Mooncake reads it) or metadata_type "etcd"; an HTTP metadata server for
    ``http(s)://host:port/metadata`` or metadata_type "http". Raises ConfigError for another (Redis)."""
    if server == P2PHANDSHAKE:
        return None
    if server.startswith(("http://", "https://")) or metadata_type == "http":
        return HttpNames(server if "://" in server else "http://" + server)
    if metadata_type in ("", "etcd") and server and ("://" not in server or server.startswith("etcd://")):
        return EtcdNames(server if "://" in server else "etcd://" + server)
    raise ConfigError(
        f"metadata server {server!r} (type {metadata_type!r}): kvplugins serves P2PHANDSHAKE (peers named "
        "host:port), etcd (etcd://host:port) and an HTTP metadata server (http://host:port/metadata); Redis is not"
    )


def _timeout_ms(core, lengths) -> float:
    return core.config.timeout_ms + sum(int(n) for n in lengths) / BYTES_PER_MS


def _ok(what: str, name: str, statuses: list) -> bool:
    bad = next((e for e in statuses if e is not None), None)
    if bad is not None:
        log.error("%s to %r failed: %s", what, name, bad)
    return bad is None


def _done(fut: Future, deadline: float, name: str) -> bool:
    """Whether the submitted batch ``fut`` to ``name`` moved every byte (waiting until ``deadline``)."""
    try:
        return _ok("batch transfer", name, fut.result(timeout=max(0.0, deadline - time.monotonic())))
    except Exception as e:  # noqa: BLE001 - a batch that did not end well is -1, as in Mooncake
        log.error("batch transfer to %r did not end: %r", name, e)
        return False
