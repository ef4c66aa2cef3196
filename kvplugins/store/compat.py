"""``MooncakeDistributedStore``: Mooncake 0.3.13's Python store API over our StoreClient, so code written for
Mooncake runs here after changing one import::

    from kvplugins.store.compat import MooncakeDistributedStore, ReplicateConfig   # was: mooncake.store

Method names, parameter names and order, defaults and **return codes** follow ``mooncake.store`` 0.3.13
(its pybind signatures, its Python API reference and its ErrorCode values in ``types.h``). This module is the
one place where Python calls answer integer codes instead of raising (kvplugins/errors.py): that is the
Mooncake contract. Codes: 0 ok; put/remove/register: 0 or a negative ErrorCode; ``get`` / ``get_batch``:
``b""`` for a miss; ``get_into``: bytes read or negative; ``is_exist``: 1 / 0 / -1; ``get_size``: bytes or
negative; ``remove_by_regex`` / ``remove_all``: number removed or negative. Errors map as: KeyNotFound (and a
checksum mismatch) -> OBJECT_NOT_FOUND (-704), a remove of a leased object without ``force`` ->
OBJECT_HAS_LEASE (-706), StoreFull -> NO_AVAILABLE_HANDLE (-200), PutPending (another writer's put of the key
has not committed) -> REPLICA_IS_NOT_READY (-703), bad arguments or a too small ``get_into``
buffer -> INVALID_PARAMS (-600), TransferFailed -> TRANSFER_FAIL (-800), MasterUnreachable -> RPC_FAIL (-900),
anything else -> INTERNAL_ERROR (-1). As Mooncake over TCP, ``put_from``/``get_into`` also accept memory that was
never registered (it is copied through the staging buffer instead of zero-copy). The codes of a test script
were checked against a real mooncake_master 0.3.13 (tests/store/test_compat.py).

Differences (docs/store.md, "Mooncake-compatible API"): ``metadata_server``, ``engine``,
``tenant_id`` and the client HTTP server are accepted and ignored (our master is the metadata server; metrics
live on the master and nodes); ``protocol`` "rdma" offers shm, rdma and tcp (``rdma_devices`` picks the NICs;
without a usable NIC RDMA is absent and tcp carries the bytes), "tcp" offers shm and tcp; the SSD offload is the
store nodes' disk tier, not the client's.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import logging

from kvplugins.errors import (BufferNotRegistered, ConfigError, KeyNotFound, KVPluginsError, MasterUnreachable,
                              PutPending, SizeMismatch, StoreError, StoreFull, TransferError)
from kvplugins.store import compat_types
from kvplugins.transfer.memory import view_of

log = logging.getLogger(__name__)

OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900


class SoftPinAction(enum.IntEnum):
    """Mooncake's ReplicateConfig.soft_pin_action."""
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """Mooncake's ReplicateConfig.data_type (accepted, not used)."""
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicateConfig:
    """Mooncake's ReplicateConfig: the attributes of 0.3.13 with their defaults, typed as its binding types them
    (a value Mooncake refuses raises TypeError on assignment; an unknown attribute raises AttributeError;
    compat_compat_types.py). Used: ``replica_num``, ``with_hard_pin``, ``soft_pin_action`` = ENABLE
    (+ ``soft_pin_ttl_ms``), ``preferred_segment`` (a segment name as ``kvplugins status`` lists it) or the
    first ``preferred_segments``. The others are accepted for compatibility and ignored. ``with_soft_pin`` is
    ours (Mooncake 0.3.13 has no such attribute): the same as soft_pin_action = ENABLE."""

    __slots__ = ("_replica_num", "_with_hard_pin", "_with_soft_pin", "_soft_pin_action", "_soft_pin_ttl_ms",
                 "_preferred_segment", "_preferred_segments", "_prefer_alloc_in_same_node",
                 "_preferred_nof_segments", "_nof_replica_num", "_dfs_replica_num", "_group_ids", "_data_type")
    replica_num = compat_types.Typed(compat_types.u64, 1)
    with_hard_pin = compat_types.Typed(compat_types.boolean, False)
    with_soft_pin = compat_types.Typed(compat_types.boolean, False)
    soft_pin_action = compat_types.Typed(compat_types.member(SoftPinAction), SoftPinAction.PRESERVE)
    soft_pin_ttl_ms = compat_types.Typed(lambda n, v: compat_types.u64(n, v, optional=True), None)
    preferred_segment = compat_types.Typed(compat_types.text, "")
    preferred_segments = compat_types.Typed(compat_types.texts, ())
    prefer_alloc_in_same_node = compat_types.Typed(compat_types.boolean, False)
    preferred_nof_segments = compat_types.Typed(compat_types.texts, ())
    nof_replica_num = compat_types.Typed(compat_types.u64, 0)
    dfs_replica_num = compat_types.Typed(compat_types.u64, 0)
    group_ids = compat_types.Typed(lambda n, v: compat_types.texts(n, v, optional=True), None)
    data_type = compat_types.Typed(compat_types.member(ObjectDataType), ObjectDataType.UNKNOWN)

    def __init__(self):
        self.preferred_segments, self.preferred_nof_segments = [], []      # a list of its own per config

    def to_put_config(self, defaults):
        """The PutConfig (store/placement.py) of this config; ``defaults``: the client's default PutConfig.
        Raises ConfigError for a bad value."""
        from kvplugins.store.placement import PutConfig
        soft = self.with_soft_pin or self.soft_pin_action == SoftPinAction.ENABLE
        pin = "hard" if self.with_hard_pin else "soft" if soft else "none"
        return PutConfig(replicas=self.replica_num, pin=pin,
                         preferred_segment=self.preferred_segment or next(iter(self.preferred_segments), ""),
                         pin_ttl_ms=self.soft_pin_ttl_ms or defaults.pin_ttl_ms)

    def __repr__(self) -> str:
        return (f"ReplicateConfig(replica_num={self.replica_num}, with_hard_pin={self.with_hard_pin}, "
                f"with_soft_pin={self.with_soft_pin}, preferred_segment={self.preferred_segment!r})")


def code_of(err: BaseException | None, *_) -> int:
    """The Mooncake ErrorCode value for one of our errors (None -> 0)."""
    if err is None:
        return OK
    for cls, code in ((KeyNotFound, OBJECT_NOT_FOUND), (StoreFull, NO_AVAILABLE_HANDLE),
                      (PutPending, REPLICA_IS_NOT_READY), (MasterUnreachable, RPC_FAIL), (BufferNotRegistered, INVALID_PARAMS),
                      (SizeMismatch, INVALID_PARAMS), (ConfigError, INVALID_PARAMS), (ValueError, INVALID_PARAMS),
                      (TypeError, INVALID_PARAMS), (TransferError, TRANSFER_FAIL)):
        if isinstance(err, cls):
            return code
    return INTERNAL_ERROR


def _guard(on_error=code_of):
    """Run the method; an exception becomes ``on_error(exception, *args)`` (its code by default)."""
    def wrap(fn):
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except (KVPluginsError, ValueError, TypeError, OSError) as e:
                log.warning("%s failed: %s", fn.__name__, e)
                return on_error(e, *args)
        return method
    return wrap


def _per_key(err, keys=(), *_):
    """on_error of the batch forms: the code once per key."""
    return [code_of(err)] * len(keys)


class MooncakeDistributedStore:
    """Mooncake's store client API on a kvplugins StoreClient (thread-safe like it). Call ``setup`` first."""

    def __init__(self):
        self._client = None
        self._buffers: dict[int, object] = {}      # registered address -> Region

    # ---- life cycle --------------------------------------------------------------------------------
    @_guard()
    def setup(self, local_hostname, metadata_server: str = "", global_segment_size: int = 16 << 20,
              local_buffer_size: int = 16 << 20, protocol: str = "tcp", rdma_devices: str = "",
              master_server_addr: str = "", engine: object = None, enable_ssd_offload: bool = False,
              ssd_offload_path: str = "", tenant_id: str = "default", enable_client_http_server: bool = False,
              client_http_port: int = 9300) -> int:
        """Connect to the master at ``master_server_addr`` ('' = the embedded `kvplugins up`) and contribute
        ``global_segment_size`` bytes as a segment (0 = none); ``local_buffer_size`` sizes the staging buffer of
        the bytes API. ``local_hostname``: the address our transfer engine binds (a ":port" is dropped). Also
        accepts Mooncake's dict form ``setup({"local_hostname": ..., "master_server_addr": ..., ...})``.
        Returns 0, or a negative code (RPC_FAIL when the master does not answer)."""
        if isinstance(local_hostname, dict):
            return self.setup(**_setup_kwargs(local_hostname))
        from kvplugins.config import load
        from kvplugins.store.client import StoreClient
        from kvplugins.store.config import ClientConfig
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol={protocol!r}: use 'tcp' or 'rdma'")
        _warn_ignored(engine, enable_ssd_offload, tenant_id, enable_client_http_server)
        host = str(local_hostname).rsplit(":", 1)[0] if str(local_hostname).count(":") == 1 else local_hostname
        cfg = dataclasses.replace(load(ClientConfig), master=master_server_addr,
                                  host="127.0.0.1" if host in ("", "localhost") else host,
                                  segment_size=int(global_segment_size),
                                  transports="shm,rdma,tcp" if protocol == "rdma" else "shm,tcp",
                                  rdma_devices=str(rdma_devices or ""),
                                  staging_size=max(int(local_buffer_size), 1 << 20))
        if self._client is not None:
            self.close()
        self._client = StoreClient(cfg)
        return OK

    def close(self) -> int:
        """Unregister this client's segment and buffers, disconnect. Returns 0. Idempotent."""
        client, self._client = self._client, None
        self._buffers.clear()
        if client is not None:
            client.close()
        return OK

    # ---- bytes API ---------------------------------------------------------------------------------
    @_guard()
    def put(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        """Store bytes-like ``value`` under ``key``. 0, or a negative code. An existing key: 0, unchanged."""
        self._c.put(key, value, self._put_cfg(config))
        return OK

    @_guard(on_error=lambda *_: b"")
    def get(self, key: str, /) -> bytes:
        """The bytes stored under ``key``; ``b""`` if it is missing (or on any error)."""
        value = self._c.batch_get([key])[0]
        return b"" if isinstance(value, StoreError) else value

    @_guard()
    def put_batch(self, keys: list[str], values: list, config: ReplicateConfig | None = None) -> int:
        """Store every ``values[i]`` under ``keys[i]`` (one allocate + one transfer + one commit). 0, or the
        first entry's negative code."""
        return _first_code(self._c.batch_put(list(keys), list(values), self._put_cfg(config)))

    @_guard(on_error=lambda err, keys=(), *_: [b""] * len(keys))
    def get_batch(self, keys: list[str], /) -> list[bytes]:
        """Per key its bytes, ``b""`` for a miss or an error."""
        values = self._c.batch_get(list(keys))
        return [b"" if isinstance(v, StoreError) else v for v in values]

    # ---- zero-copy API -----------------------------------------------------------------------------
    @_guard()
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``size`` bytes at address ``buffer_ptr`` for put_from/get_into. 0 or a negative code."""
        self._buffers[int(buffer_ptr)] = self._c.register_buffer(int(buffer_ptr), length=int(size))
        return OK

    @_guard()
    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Unregister the buffer registered at ``buffer_ptr``. 0, or INVALID_PARAMS if it was not."""
        region = self._buffers.pop(int(buffer_ptr), None)
        if region is None:
            raise BufferNotRegistered(f"no buffer was registered at address {buffer_ptr:#x}")
        self._c.unregister_buffer(region)
        return OK

    @_guard()
    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Store ``size`` bytes at address ``buffer_ptr`` (registered: zero-copy) under ``key``. 0 or negative."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    @_guard()
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read object ``key`` into the registered buffer at ``buffer_ptr`` of capacity ``size`` bytes.
        Returns the object's size (bytes read), or a negative code (INVALID_PARAMS if it does not fit)."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    @_guard(on_error=_per_key)
    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """Per key 0 or a negative code; one allocate + one transfer + one commit for the batch."""
        _same_length(keys, buffer_ptrs, sizes)
        keys, cfg = list(keys), self._put_cfg(config)
        spans = [[(int(p), int(n))] for p, n in zip(buffer_ptrs, sizes)]
        errs = self._c.batch_put_from(keys, spans, cfg)
        copy = [i for i, e in enumerate(errs) if isinstance(e, BufferNotRegistered) and _plausible(*spans[i][0])]
        if copy:
            redo = self._c.batch_put([keys[i] for i in copy], [_memory(*spans[i][0]) for i in copy], cfg)
            for i, err in zip(copy, redo):
                errs[i] = err
        return [code_of(e) for e in errs]

    @_guard(on_error=_per_key)
    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        """Per key the bytes read or a negative code: one size lookup, then one read batch."""
        _same_length(keys, buffer_ptrs, sizes)
        keys, ptrs, caps = list(keys), [int(p) for p in buffer_ptrs], list(sizes)
        out = [n if n <= cap else INVALID_PARAMS          # Mooncake: "User buffer too small"
               for n, cap in zip(self._sizes(keys), caps)]
        todo = [i for i, n in enumerate(out) if n >= 0]
        errs = self._c.batch_get_into([keys[i] for i in todo], [[(ptrs[i], out[i])] for i in todo])
        copy = {i for i, err in zip(todo, errs) if isinstance(err, BufferNotRegistered) and _plausible(ptrs[i], out[i])}
        for i, err in zip(todo, errs):
            if err is not None and i not in copy:
                out[i] = code_of(err)
        self._copy_into(keys, ptrs, caps, sorted(copy), out)
        return out

    def _copy_into(self, keys, ptrs, caps, idx: list[int], out: list[int]) -> None:
        """get_into of memory that was never registered: read through the staging buffer, then copy (as Mooncake
        does over TCP). Sets ``out[i]`` to the bytes copied or a code."""
        if idx:
            for i, value in zip(idx, self._c.batch_get([keys[i] for i in idx])):
                out[i] = code_of(value) if isinstance(value, StoreError) else _copy_out(ptrs[i], value, caps[i])

    # ---- metadata ----------------------------------------------------------------------------------
    def is_exist(self, key: str, /) -> int:
        """1 if ``key`` is stored, 0 if not, -1 on error."""
        return self.batch_is_exist([key])[0]

    @_guard(on_error=lambda err, keys=(), *_: [-1] * len(keys))
    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """Per key 1 (stored), 0 (not), -1 (error); one RPC."""
        return [1 if e else 0 for e in self._c.batch_exists(list(keys))]

    @_guard()
    def get_size(self, key: str, /) -> int:
        """The size in bytes of object ``key``, or a negative code (OBJECT_NOT_FOUND)."""
        return self._sizes([key])[0]

    @_guard()
    def remove(self, key: str, force: bool = False) -> int:
        """Remove ``key``: 0, OBJECT_NOT_FOUND, or OBJECT_HAS_LEASE while a read lease runs (unless ``force``;
        even then the reader's bytes stay valid until its lease ends)."""
        [result] = self._call("remove_checked", [key], {"force": bool(force)})
        return {"removed": OK, "leased": OBJECT_HAS_LEASE}.get(result, OBJECT_NOT_FOUND)

    @_guard()
    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove every object whose key matches ``regex_pattern`` (Python ``re.search``), leased ones only with
        ``force``. The number removed, or INVALID_PARAMS for a pattern that does not compile."""
        return self._count("remove_by_regex", [regex_pattern], force)

    @_guard()
    def remove_all(self, force: bool = False) -> int:
        """Remove every object (leased ones only with ``force``). The number removed, or a negative code."""
        return self._count("remove_all", [], force)

    # ---- internals ---------------------------------------------------------------------------------
    @property
    def _c(self):
        if self._client is None:
            raise StoreError("MooncakeDistributedStore: call setup(...) first")
        return self._client

    def _put_cfg(self, config: ReplicateConfig | None):
        from kvplugins.store.placement import from_client
        return None if config is None else config.to_put_config(from_client(self._c.cfg))

    def _call(self, op: str, entries: list, opts: dict | None = None):
        """One master op (the admin ops of store/master/admin_ops.py) on the client's master connection."""
        return self._c._rpc.call(op, entries, opts)

    def _sizes(self, keys: list[str]) -> list[int]:
        from kvplugins.store.protocol import OK as FOUND
        found = self._call("get_size", list(keys))
        return [size if code == FOUND else OBJECT_NOT_FOUND for code, size in found]

    def _count(self, op: str, entries: list, force: bool) -> int:
        from kvplugins.store.protocol import OK as DONE
        code, value = self._call(op, entries, {"force": bool(force)})
        if code != DONE:
            raise ValueError(value)
        return int(value)


def _plausible(addr: int, nbytes: int) -> bool:
    """A raw span worth copying through (never NULL, never negative); anything else stays INVALID_PARAMS."""
    return addr > 4096 and nbytes > 0


def _memory(addr: int, nbytes: int) -> memoryview:
    """A view of ``nbytes`` at a raw address the caller owns (Mooncake's put_from of unregistered memory)."""
    return view_of(addr, nbytes)


def _copy_out(addr: int, value: bytes, capacity: int) -> int:
    if len(value) > capacity:
        return INVALID_PARAMS
    view_of(addr, len(value))[:] = value
    return len(value)


def _first_code(errors) -> int:
    return next((code_of(e) for e in errors if e is not None), OK)


def _same_length(*lists) -> None:
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"keys, buffer_ptrs and sizes must have the same length, got {[len(x) for x in lists]}")


SETUP_KEYS = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size", "protocol",
              "rdma_devices", "master_server_addr", "enable_ssd_offload", "ssd_offload_path", "tenant_id",
              "enable_client_http_server", "client_http_port")


def _setup_kwargs(config: dict) -> dict:
    """Mooncake's dict form of setup -> keyword arguments (ipc_socket_path is accepted and ignored)."""
    unknown = set(config) - set(SETUP_KEYS) - {"ipc_socket_path"}
    if unknown or "local_hostname" not in config:
        raise ConfigError(f"setup dict: unknown keys {sorted(unknown)} or no local_hostname; valid: {SETUP_KEYS}")
    return {k: v for k, v in config.items() if k in SETUP_KEYS}


def _warn_ignored(engine, ssd, tenant, http) -> None:
    for cond, what in ((engine is not None, "engine: our client runs its own transfer engine"),
                       (ssd, "enable_ssd_offload: the disk tier lives on store nodes (--disk-dir)"),
                       (tenant != "default", f"tenant_id {tenant!r}: one namespace per master"),
                       (http, "enable_client_http_server: metrics are on the master and nodes (--metrics-port)")):
        if cond:
            log.warning("MooncakeDistributedStore.setup: %s", what)
