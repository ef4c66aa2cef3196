"""Mooncake 0.3.13's replica and range reads, a mixin of api.MooncakeDistributedStore: ``get_replica_desc``,
``batch_get_replica_desc``, ``batch_replica_clear``, ``get_into_ranges`` and ``put_from_with_metadata``. Shapes
and codes as a real mooncake_master answered them (tests/store/test_mooncake_api.py): a missing key has no
descriptors (and no entry in the batch dict), a range of a missing object answers OBJECT_NOT_FOUND.

A descriptor names our location: ``transport_endpoint`` is the segment name (`kvplugins status`),
``buffer_address`` the object's offset inside that segment's region (Mooncake: the owner's virtual address),
``size`` the object's bytes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from kvplugins.store.wire import protocol, replies
from kvplugins.mooncake.codes import INVALID_PARAMS, OBJECT_NOT_FOUND, guard, code_of, pybind
from kvplugins.mooncake.checks import DEFAULT, ReplicateConfig


class ReplicaStatus(enum.IntEnum):
    """Mooncake's ReplicaStatus (every replica a get returns is COMPLETE)."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


@dataclass(frozen=True)
class Descriptor:
    buffer_address: int
    size: int
    transport_endpoint: str


@dataclass(frozen=True)
class MemoryDescriptor:
    buffer_descriptor: Descriptor


class ReplicaDescriptor:
    """One DRAM replica of an object (Mooncake's ReplicaDescriptor; our store has no disk replicas to describe)."""

    def __init__(self, segment: str, offset: int, size: int):
        self._memory = MemoryDescriptor(Descriptor(offset, size, segment))
        self.status = ReplicaStatus.COMPLETE

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self):
        raise RuntimeError("not a disk replica (kvplugins describes DRAM replicas only)")


class ReplicaMethods:
    """Mixed into MooncakeDistributedStore (``_c``, ``_call``, ``_put_cfg``, ``batch_put_from_multi_buffers``)."""

    @pybind
    @guard(on_error=lambda *_: [])
    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The replicas of ``key`` ([] when it is missing)."""
        return self.batch_get_replica_desc([key]).get(key, [])

    @pybind
    @guard(on_error=lambda *_: {})
    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """Key -> its replicas, for the keys that are stored (one lookup; it takes a read lease as a get)."""
        out = {}
        for key, (code, value) in zip(keys, self._c.locate(list(keys))):
            if code == protocol.OK:
                out[key] = [ReplicaDescriptor(loc.segment, loc.offset, value.size) for loc in value.replicas]
        return out

    @pybind
    @guard(on_error=lambda *_: [])
    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        """Drop the replicas of ``keys`` whose read lease has ended: every replica (the object goes), or with
        ``segment_name`` only the replica on that segment (an object left without one goes); returns the keys
        cleared. Chosen by the master in one pass, taking no lease (Mooncake 0.3.13 BatchReplicaClear)."""
        opts = {"force": False, "segment": segment_name} if segment_name else {"force": False}
        results = replies.outcomes(self._call("remove_checked", list(keys), opts), "remove_checked")
        return [k for k, r in zip(keys, results) if r in ("removed", "cleared")]

    @pybind
    @guard()
    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: ReplicateConfig = DEFAULT,
    ) -> int:
        """Store ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by ``size`` bytes at ``buffer_ptr``
        as one object (registered memory, zero-copy). 0 or a negative code."""
        return self.batch_put_from_multi_buffers(
            [key], [[metadata_buffer_ptr, buffer_ptr]], [[metadata_size, size]], config
        )[0]

    @pybind
    @guard(on_error=lambda err, ptrs=(), keys=(), *_: [[[code_of(err)] for _ in ks] for ks in keys])
    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]:
        """For buffer b and its keys k, copy object bytes [src, src + size) to buffer_ptrs[b] + dst, range by
        range. Per range the bytes copied, or a code (OBJECT_NOT_FOUND, INVALID_PARAMS past the object's end);
        one lookup and one transfer batch for everything (ranges read past the lookup's lease: looked up and read
        again, StoreClient.transfer_ranges)."""
        flat = [(b, k, key) for b, keys in enumerate(all_keys) for k, key in enumerate(keys)]
        wanted = sorted({key for _, _, key in flat})
        t0, found = time.monotonic(), dict(zip(wanted, self._c.locate(wanted)))
        entries, spans, offs, locations, out = [], [], [], {}, []
        for b, keys in enumerate(all_keys):
            out.append([])
            for k, key in enumerate(keys):
                dst, src, n = all_dst_offsets[b][k], all_src_offsets[b][k], all_sizes[b][k]
                code, value = found[key]
                if code != protocol.OK:
                    out[b].append([OBJECT_NOT_FOUND] * max(1, len(n)))
                    continue
                ok = len(dst) == len(src) == len(n) and all(s + m <= value.size for s, m in zip(src, n))
                out[b].append(list(n) if ok else [INVALID_PARAMS] * max(1, len(n)))
                if ok:
                    locations[len(entries)] = value.replicas
                    entries.append((b, k, key, value.lease_ttl_ms))
                    spans.append([(buffer_ptrs[b] + d, m) for d, m in zip(dst, n)])
                    offs.append(list(src))
        lease_end = t0 + min((e[3] for e in entries), default=0) / 1000
        errs = self._c.transfer_ranges("read", [e[2] for e in entries], spans, offs, locations, lease_end)
        for (b, k, _, _), err in zip(entries, errs):
            if err is not None:
                out[b][k] = [code_of(err)] * len(out[b][k])
        return out
