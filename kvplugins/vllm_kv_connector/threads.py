"""Which CPUs the connector's worker threads run on.

vLLM's CPU worker binds its OpenMP threads one per CPU (GOMP_CPU_AFFINITY / KMP_AFFINITY from
vllm/utils/ompmultiprocessing.py), the main thread included, and Linux gives a new thread its creator's CPU
mask. Left alone, every thread the connector starts in a worker (the kvp-load / kvp-save threads, the transfer
core's TCP server, connection and I/O threads) would be pinned to the one CPU of the main thread, where it
waits behind the forward pass, vLLM's busy-polling message loop, and the main thread of every other vLLM
engine on the host (they all take the first CPU of their list). Measured on this 2-CPU host: every thread of a
vLLM 0.32 CPU worker but one OpenMP thread had ``Cpus_allowed_list: 0``. These helpers give connector threads
the union of the CPUs vLLM gave the worker's threads instead. Linux only; elsewhere they change nothing.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


def worker_cpus() -> set[int]:
    """The union of the CPU masks of this process's threads (the CPUs vLLM gave this worker), or the calling
    thread's mask where per-thread masks cannot be read."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    cpus: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return cpus or set(os.sched_getaffinity(0))


def unpin() -> None:
    """Let the calling thread run on every CPU of ``worker_cpus()`` (best effort: an error leaves its mask)."""
    cpus = worker_cpus()
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)  # 0 = the calling thread
        except OSError:
            pass


def pool(name: str) -> ThreadPoolExecutor:
    """A one-thread executor whose thread runs unpinned (``unpin``)."""
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=unpin)


def run_unpinned(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a short-lived unpinned thread, so the threads it starts (e.g. a transfer engine's TCP
    server) inherit the wide mask. Returns its result; re-raises its exception."""
    with pool("kvp-init") as ex:
        return ex.submit(fn, *args).result()
