"""One adapter per store, used inside a worker process. ``bind(op, keys, size)`` returns a zero-argument call
that does exactly one store call (single form for one key, batch form otherwise) on the registered buffer and
raises OpFailed unless every key succeeded; argument lists are built before timing starts, for both stores."""

from __future__ import annotations

import os
from typing import Callable

import numpy as np


class OpFailed(RuntimeError):
    """A put/get/remove did not succeed for every key; the message names the first failure."""


class KvpClient:
    """Our store: ``StoreClient`` with zero-copy put_from/get_into (spans in one registered buffer)."""

    def __init__(self, cfg: dict, buf: np.ndarray | None):
        from kvplugins.store import ClientConfig, StoreClient

        self.client = StoreClient(
            ClientConfig(
                master=cfg["master"], transports=cfg["transports"], rpc_timeout_ms=cfg.get("rpc_timeout_ms", 10000)
            )
        )
        self.buf = buf
        if buf is not None:
            self.client.register_buffer(buf)

    def bind(self, op: str, keys: list[str], size: int) -> Callable[[], None]:
        base, c = self.buf.ctypes.data, self.client
        if len(keys) == 1:
            one = c.put_from if op == "put" else c.get_into
            key, spans = keys[0], [(base, size)]
            return lambda: one(key, spans)
        many = c.batch_put_from if op == "put" else c.batch_get_into
        spans_per_key = [[(base + j * size, size)] for j in range(len(keys))]
        return lambda: _check(op, keys, many(keys, spans_per_key), lambda r: r is None)

    def remove(self, keys: list[str]) -> None:
        _check("remove", keys, self.client.batch_remove(keys), lambda r: r is None)

    def stats(self) -> dict:
        """The client's stats plus its transfer engine's per-transport counters (which transport moved the
        bytes: proves shm vs forced TCP). The engine is the client's private attribute: diagnostics only."""
        engine = getattr(self.client, "_engine", None)
        return {**self.client.stats(), "transfer": engine.stats() if engine is not None else None}

    def close(self) -> None:
        self.client.close()


class MooncakeClient:
    """Mooncake's ``MooncakeDistributedStore`` over its TCP protocol, zero-copy on a registered buffer.

    Follows the wheel's documented API: setup(local_hostname, metadata_server, global_segment_size,
    local_buffer_size, protocol, rdma_devices, master_server_addr); put_from/batch_put_from return 0 per key;
    get_into/batch_get_into return the bytes read (negative = error code)."""

    def __init__(self, cfg: dict, buf: np.ndarray | None, segment_bytes: int = 0):
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", cfg["host"])  # else it looks for a non-loopback LAN address
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            cfg["host"], cfg["metadata"], segment_bytes, cfg.get("local_buffer", 16 << 20), "tcp", "", cfg["master"]
        )
        if rc != 0:
            raise OpFailed(f"mooncake setup failed rc={rc} (master {cfg['master']}, metadata {cfg['metadata']})")
        self.buf = buf
        if buf is not None and (rc := self.store.register_buffer(buf.ctypes.data, buf.nbytes)) != 0:
            raise OpFailed(f"mooncake register_buffer of {buf.nbytes} bytes failed rc={rc}")

    def bind(self, op: str, keys: list[str], size: int) -> Callable[[], None]:
        base, s = self.buf.ctypes.data, self.store
        want = (lambda r: r == 0) if op == "put" else (lambda r: r == size)
        if len(keys) == 1:
            one = s.put_from if op == "put" else s.get_into
            key = keys[0]
            return lambda: _check(op, keys, [one(key, base, size)], want)
        many = s.batch_put_from if op == "put" else s.batch_get_into
        ptrs, sizes = [base + j * size for j in range(len(keys))], [size] * len(keys)
        return lambda: _check(op, keys, many(keys, ptrs, sizes), want)

    def remove(self, keys: list[str]) -> None:
        _check("remove", keys, self.store.batch_remove(keys, True), lambda r: r == 0)

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        self.store.close()


def _check(op: str, keys: list[str], results, ok) -> None:
    for key, r in zip(keys, results):
        if not ok(r):
            raise OpFailed(f"{op} of {key!r} failed: {r!r}")


def open_client(backend: str, cfg: dict, buf: np.ndarray | None, segment_bytes: int = 0):
    """The adapter for ``backend`` ("kvp" or "mooncake")."""
    if backend == "kvp":
        return KvpClient(cfg, buf)
    if backend == "mooncake":
        return MooncakeClient(cfg, buf, segment_bytes)
    raise ValueError(f"unknown backend {backend!r}; use kvp or mooncake")
