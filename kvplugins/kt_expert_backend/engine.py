"""The per-process CPU engine that every layer's wrapper shares: one worker pool and the ledger of deferred
expert outputs waiting for the next layer.

SGLang builds one KTMoEWrapper per MoE layer, each with the same cpuinfer_threads/threadpool_count; like kt-kernel
(its CPUInfer singleton), they must share one pool, or N layers would start N pools. This registry is the only
process-wide state of the backend.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

from kvplugins.kt_expert_backend import native
from kvplugins.kt_expert_backend.stream import StreamState

log = logging.getLogger("kvplugins.kt")


def numa_node_count(root: str = native.NODE_ROOT) -> int:
    try:
        return sum(1 for d in os.listdir(root) if d.startswith("node") and d[4:].isdigit())
    except OSError:
        return 1


@dataclass
class Pending:
    """Deferred experts of layer L, computed into ``out`` (float32 [T, H]); layer L+1 adds onto it."""

    ticket: int
    out: object
    keep: tuple  # arrays the queued job reads; alive until the job ran


@dataclass
class Engine:
    pool: native.Pool
    pending: dict = field(default_factory=dict)  # target layer index -> Pending
    stream: StreamState = field(default_factory=StreamState)  # GPU callers' fixed buffers (stream.py)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Engines:
    """Process registry of engines keyed by (threads, subpools, nodes, spin_us, node_root, sync_spin_us)."""

    _engines: dict = {}
    _lock = threading.Lock()

    @classmethod
    def get(
        cls,
        threads: int,
        subpools: int,
        numa_nodes,
        spin_us: int,
        node_root: str = native.NODE_ROOT,
        sync_spin_us: int = 0,
    ) -> Engine:
        auto = tuple(range(subpools)) if numa_node_count(node_root) >= subpools > 1 else ()
        nodes = tuple(numa_nodes) if numa_nodes else auto
        key = (int(threads), int(subpools), nodes, int(spin_us), node_root, int(sync_spin_us))
        with cls._lock:
            eng = cls._engines.get(key)
            if eng is None:
                eng = cls._engines[key] = Engine(
                    native.Pool(threads, subpools, list(nodes), spin_us, node_root, wait_spin_us=sync_spin_us)
                )
                log.info("kt expert backend: %s (kernels: %s)", eng.pool.describe(), native.describe_isa())
            return eng
