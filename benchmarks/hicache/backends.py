"""Each HiCache L3 backend the benchmark compares, built and attached the way SGLang 0.5.23 does, with the page IO
helper its controller would pick (``attach_storage_backend``): zero-copy v1 for kvplugins (interface_v1) and
mooncake, the generic flat-page path for file. Servers come from benchmarks/storebench/clusters.py."""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory
from storebench import clusters

ZERO_COPY = ("kvp-shm", "kvp-tcp", "mooncake-tcp")


@dataclass
class Attached:
    """A backend attached to a host pool, driven through the controller's own page IO helpers."""

    label: str
    backend: object
    pool: object
    ctl: HiCacheController
    after_set: Callable[[], None] | None = None  # untimed, between a round's set and its get

    def set(self, keys: list[str], idx: torch.Tensor) -> bool:
        return bool(self.ctl.page_set_func(keys, idx))

    def get(self, keys: list[str], idx: torch.Tensor) -> int:
        op = PrefetchOperation("bench", list(range(idx.numel())), None, None)
        return self.ctl.page_get_func(op, keys, idx)

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()


def storage_config(extra: dict | None) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="meta-llama/Meta-Llama-3-8B",
        extra_config=extra,
    )


def attach(label: str, name: str, extra: dict | None, pool) -> Attached:
    backend = StorageBackendFactory.create_backend(name, storage_config(extra), pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    ctl = object.__new__(HiCacheController)
    ctl.storage_backend, ctl.storage_host_pool, ctl.mem_pool_host, ctl.page_size = backend, pool, pool, pool.page_size
    zero = label in ZERO_COPY
    ctl.page_get_func = ctl._page_get_zero_copy if zero else ctl._generic_page_get
    ctl.page_set_func = ctl._page_set_zero_copy if zero else ctl._generic_page_set
    return Attached(label, backend, pool, ctl)


@contextlib.contextmanager
def kvp(mode: str, data_bytes: int, log_dir: Path) -> Iterator[callable]:
    """Our store (kvplugins master + one store node, transports of ``mode``); yields pool -> Attached."""
    with clusters.kvp(mode, data_bytes, log_dir) as t:
        extra = {
            "backend_name": "kvplugins",
            "module_path": "kvplugins.sglang_hicache_backend",
            "class_name": "KVPluginsHiCacheStorage",
            "interface_v1": 1,
            "store": {"master": t.cfg["master"], "transports": t.cfg["transports"]},
        }
        yield lambda pool: attach(t.label, "dynamic", extra, pool)


@contextlib.contextmanager
def file(log_dir: Path, cold: bool = False) -> Iterator[callable]:
    """SGLang's HiCacheFile, one file per page under ``log_dir/<label>`` (removed on exit). cold: after each set
    (untimed), the pages are flushed and dropped from the page cache (fsync + POSIX_FADV_DONTNEED), so the get
    reads the disk as an L3 read of pages written long ago would; otherwise the get is served from the page
    cache."""
    label = "file-cold" if cold else "file"
    directory = log_dir / label

    def make(pool) -> Attached:
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(directory)  # read by HiCacheFile.__init__
        att = attach(label, "file", None, pool)
        if cold:
            att.after_set = lambda: drop_page_cache(directory)
        return att

    try:
        yield make
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # GBs of page files per layout


def drop_page_cache(directory: Path) -> None:
    """Write back and evict every file of ``directory`` from the page cache (this run's files only)."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@contextlib.contextmanager
def mooncake(data_bytes: int, log_dir: Path) -> Iterator[callable]:
    """SGLang's MooncakeStore (TCP) on mooncake_master + one segment process (inside the private netns)."""
    with clusters.mooncake(data_bytes, log_dir) as t:
        os.environ["MC_TCP_BIND_ADDRESS"] = t.env["MC_TCP_BIND_ADDRESS"]
        extra = {
            "master_server_address": t.cfg["master"],
            "metadata_server": t.cfg["metadata"],
            "global_segment_size": 0,
            "protocol": "tcp",
            "device_name": "",
            "local_hostname": t.cfg["host"],
            "check_server": False,
        }
        yield lambda pool: attach(t.label, "mooncake", extra, pool)
