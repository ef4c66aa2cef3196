"""Connector threads are not confined to the CPU vLLM pins a worker's main thread to (kvplugins/vllm_kv_connector/
threads.py): a thread pinned to one CPU, as vLLM's OpenMP binding leaves the worker's main thread, starts a real
transfer engine through ``run_unpinned``; the engine's TCP server threads (which serve P/D direct reads) and a
``pool`` thread may run on every CPU the process's threads had. Needs >= 2 CPUs."""

from __future__ import annotations

import os
import threading

import pytest
from helpers.installed import require

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(60)]
if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs Linux CPU affinity and >= 2 CPUs", allow_module_level=True)


def native_tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def test_threads_started_from_a_pinned_thread_get_every_worker_cpu():
    from kvplugins.transfer import TransferConfig, TransferEngine
    from kvplugins.vllm_kv_connector import threads

    everything = set(os.sched_getaffinity(0))
    first = min(everything)
    out: dict = {}

    def pinned_main():  # stands for the vLLM worker's main thread
        os.sched_setaffinity(0, {first})
        before = native_tids()
        out["engine"] = threads.run_unpinned(TransferEngine, TransferConfig(transports="tcp"))
        out["new"] = native_tids() - before
        with threads.pool("kvp-test") as ex:
            out["pool"] = ex.submit(os.sched_getaffinity, 0).result()
        out["own"] = os.sched_getaffinity(0)

    t = threading.Thread(target=pinned_main)
    t.start()
    t.join()
    try:
        assert out["own"] == {first}  # the caller itself stays pinned
        assert out["pool"] == everything
        # the engine's TCP server accept and event threads, which live until it closes: a short-lived thread that
        # started in the window may be gone by now (sched_getaffinity raised ProcessLookupError in one CI run)
        server = ("kvp-tcp-accept", "kvp-tcp-events")
        alive = {t.native_id for t in threading.enumerate() if t.name.startswith(server)} & out["new"]
        masks = {tid: os.sched_getaffinity(tid) for tid in alive}
        assert alive and all(m == everything for m in masks.values()), (masks, everything)
    finally:
        out["engine"].close()
