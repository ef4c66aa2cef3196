"""``MooncakeDistributedStore``: Mooncake 0.3.13's Python store API over our StoreClient, so code written for
Mooncake runs here after changing one import::

    from kvplugins.mooncake import MooncakeDistributedStore, ReplicateConfig   # was: mooncake.store

Method names, parameter names and order, defaults and **return codes** follow ``mooncake.store`` 0.3.13
(its pybind signatures, its Python API reference and its ErrorCode values in ``types.h``); 86 of its 97 methods
(api.py and extra.py; the list: docs/store.md). Arguments are checked as its pybind11 binding
checks them (codes.pybind): a missing, unknown or mistyped argument raises TypeError. Past that, this
module is the one place where Python calls answer integer codes instead of raising (kvplugins/errors.py): that
is the Mooncake contract. Codes: 0 ok; put/remove/register: 0 or a negative ErrorCode; ``get`` / ``get_batch``:
``b""`` for a miss; ``get_into``: bytes read or negative; ``is_exist``: 1 / 0 / -1; ``get_size``: bytes or
negative; ``remove_by_regex`` / ``remove_all``: number removed or negative. Errors map as (codes.code_of):
KeyNotFound (and a checksum mismatch) -> OBJECT_NOT_FOUND (-704), a remove of a leased object without ``force``
-> OBJECT_HAS_LEASE (-706), StoreFull -> NO_AVAILABLE_HANDLE (-200), PutPending -> REPLICA_IS_NOT_READY (-703),
bad values (e.g. ``replica_num = 0``, a too small ``get_into`` buffer) -> INVALID_PARAMS (-600), TransferFailed
-> TRANSFER_FAIL (-800), MasterUnreachable -> RPC_FAIL (-900), anything else -> INTERNAL_ERROR (-1). As Mooncake
over TCP, ``put_from``/``get_into`` also accept memory that was never registered (copied through the staging
buffer). The codes of two test scripts were checked against a real mooncake_master 0.3.13
(tests/store/test_mooncake_api.py, mooncake_crosscheck.py).

Differences (docs/store.md, "Mooncake-compatible API"): ``metadata_server``, ``engine``,
``tenant_id`` and the client HTTP server are accepted and ignored (our master is the metadata server; metrics
live on the master and nodes); ``protocol`` "rdma" offers shm, rdma and tcp (``rdma_devices`` picks the NICs;
without a usable NIC RDMA is absent and tcp carries the bytes), "tcp" offers shm and tcp; the SSD offload is the
store nodes' disk tier, not the client's.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvplugins.errors import BufferNotRegistered, ConfigError, StoreError
from kvplugins.mooncake import checks
from kvplugins.mooncake.checks import Buffer, ReplicateConfig
from kvplugins.mooncake.checks import same_length as _same_length
from kvplugins.mooncake.codes import (
    INVALID_PARAMS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    OK,
    guard,
    per_key,
    code_of,
    pybind,
)
from kvplugins.mooncake.extra import ExtraMethods
from kvplugins.mooncake.replicas import ReplicaMethods
from kvplugins.mooncake.parallel import ParallelMethods
from kvplugins.mooncake.sessions import SessionMethods
from kvplugins.mooncake.tasks import TaskMethods
from kvplugins.store.wire import replies
from kvplugins.mooncake.tensor_buffers import TensorBufferMethods
from kvplugins.transfer.memory import view_of

if TYPE_CHECKING:
    from kvplugins.store.client.store_client import StoreClient
    from kvplugins.store.placement import PutConfig

log = logging.getLogger(__name__)
DEFAULT = checks.DEFAULT  # a method's default ReplicateConfig (Mooncake's: a default-built one)


class MooncakeDistributedStore(
    ExtraMethods, SessionMethods, ReplicaMethods, TensorBufferMethods, TaskMethods, ParallelMethods
):
    """Mooncake's store client API on a kvplugins StoreClient (thread-safe like it). Call ``setup`` first."""

    def __init__(self) -> None:
        self._client: StoreClient | None = None
        self._hostname, self._bytes_api = "", True
        # weakref.finalize: closes the StoreClient when this store is collected or at exit
        self._closer: weakref.finalize[[], MooncakeDistributedStore] | None = None
        self._buffers: dict[int, object] = {}  # registered address -> Region

    # ---- life cycle --------------------------------------------------------------------------------
    def setup(self, *args: object, **kwargs: object) -> int:
        """Mooncake's two overloads: ``setup(local_hostname, metadata_server, global_segment_size,
        local_buffer_size, protocol, rdma_devices, master_server_addr, ...)`` (see _setup) or
        ``setup(config: dict)`` with the same names as keys (sizes may be strings: "16MB" = 16 MiB, as
        Mooncake's parser reads them). Returns 0, or a negative code."""
        if len(args) == 1 and not kwargs and isinstance(args[0], dict):
            return self._setup_dict(args[0])
        return self._setup_call(args, kwargs)

    @guard()
    def _setup_dict(self, config: dict[str, object]) -> int:
        return self._setup_call((), _setup_kwargs(config))

    def _setup_call(self, args: tuple[object, ...], kwargs: dict[str, object]) -> int:
        """_setup with ``args``/``kwargs`` bound and converted as pybind11 would (a TypeError naming the supported
        form for a missing, unknown or mistyped argument)."""
        bound = checks.check_call(self._setup, SETUP_SIGNATURE, SETUP_CASTS, args, kwargs)
        return self._setup(*bound.args, **bound.kwargs)

    @pybind
    @guard()
    def _setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
        engine: object = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
    ) -> int:
        """Connect to the master at ``master_server_addr`` ('' = the embedded `kvplugins up`) and contribute
        ``global_segment_size`` bytes as a segment (0 = none); ``local_buffer_size`` sizes the staging buffer of
        the bytes API (0: no bytes API, its puts answer INVALID_PARAMS and its gets b"", as Mooncake's).
        ``local_hostname``: the address our transfer engine binds (a ":port" is dropped). Returns 0, or a
        negative code (RPC_FAIL when the master does not answer). A store never closed unregisters its segment
        when it is garbage-collected, or at interpreter exit."""
        from kvplugins.config import Bytes, load
        from kvplugins.store.client import StoreClient
        from kvplugins.store.config import ClientConfig

        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol={protocol!r}: use 'tcp' or 'rdma'")
        _warn_ignored(engine, enable_ssd_offload, tenant_id, enable_client_http_server)
        host = local_hostname.rsplit(":", 1)[0] if local_hostname.count(":") == 1 else local_hostname
        cfg = dataclasses.replace(
            load(ClientConfig),
            master=master_server_addr,
            host="127.0.0.1" if host in ("", "localhost") else host,
            segment_size=Bytes(int(global_segment_size)),
            transports="shm,cma,rdma,tcp" if protocol == "rdma" else "shm,cma,tcp",
            rdma_devices=str(rdma_devices or ""),
            staging_size=Bytes(max(int(local_buffer_size), 1 << 20)),
        )
        if self._client is not None:
            self.close()
        self._client = StoreClient(cfg)
        self._hostname, self._bytes_api = local_hostname, local_buffer_size > 0
        # a store never closed unregisters its segment when it is garbage-collected, or at interpreter exit
        # (Mooncake's destructor and exit handler do), not after the heartbeat timeout, when puts placed there
        # would already have failed; the finalizer holds the client, not this store
        self._closer = weakref.finalize(self, self._client.close)
        return OK

    @pybind
    def close(self) -> int:
        """Unregister this client's segment and buffers, disconnect. Returns 0. Idempotent."""
        closer, self._client, self._closer = self._closer, None, None
        self._buffers.clear()
        if closer is not None:
            closer()  # StoreClient.close, once
        return OK

    # ---- bytes API ---------------------------------------------------------------------------------
    @pybind
    @guard()
    def put(self, key: str, value: Buffer, config: ReplicateConfig = DEFAULT) -> int:
        """Store bytes-like ``value`` under ``key``. 0, or a negative code. An existing key: 0, unchanged."""
        self._cb.put(key, value, self._put_cfg(config))
        return OK

    @pybind
    @guard(on_error=lambda *_: b"")
    def get(self, key: str, /) -> bytes:
        """The bytes stored under ``key``; ``b""`` if it is missing (or on any error)."""
        value = self._cb.batch_get([key])[0]
        return b"" if isinstance(value, StoreError) else value

    @pybind
    @guard()
    def put_batch(self, keys: list[str], values: list[Buffer], config: ReplicateConfig = DEFAULT) -> int:
        """Store every ``values[i]`` under ``keys[i]`` (one allocate + one transfer + one commit). 0, or the
        first entry's negative code."""
        return _first_code(self._cb.batch_put(list(keys), list(values), self._put_cfg(config)))

    @pybind
    @guard(on_error=lambda err, keys=(), *_: [b""] * len(keys))
    def get_batch(self, keys: list[str], /) -> list[bytes]:
        """Per key its bytes, ``b""`` for a miss or an error."""
        values = self._cb.batch_get(list(keys))
        return [b"" if isinstance(v, StoreError) else v for v in values]

    # ---- zero-copy API -----------------------------------------------------------------------------
    @pybind
    @guard()
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``size`` bytes at address ``buffer_ptr`` for put_from/get_into. 0 or a negative code."""
        self._buffers[int(buffer_ptr)] = self._c.register_buffer(int(buffer_ptr), length=int(size))
        return OK

    @pybind
    @guard()
    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Unregister the buffer registered at ``buffer_ptr``. 0, or INVALID_PARAMS if it was not."""
        region = self._buffers.pop(int(buffer_ptr), None)
        if region is None:
            raise BufferNotRegistered(f"no buffer was registered at address {buffer_ptr:#x}")
        self._c.unregister_buffer(region)
        return OK

    @pybind
    @guard()
    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig = DEFAULT) -> int:
        """Store ``size`` bytes at address ``buffer_ptr`` (registered: zero-copy) under ``key``. 0 or negative."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    @pybind
    @guard()
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read object ``key`` into the registered buffer at ``buffer_ptr`` of capacity ``size`` bytes.
        Returns the object's size (bytes read), or a negative code (INVALID_PARAMS if it does not fit)."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    @pybind
    @guard(on_error=per_key)
    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig = DEFAULT
    ) -> list[int]:
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

    @pybind
    @guard(on_error=per_key)
    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        """Per key the bytes read or a negative code: one size lookup, then one read batch."""
        _same_length(keys, buffer_ptrs, sizes)
        keys, ptrs, caps = list(keys), [int(p) for p in buffer_ptrs], list(sizes)
        out = [
            n if n <= cap else INVALID_PARAMS  # Mooncake: "User buffer too small"
            for n, cap in zip(self._sizes(keys), caps)
        ]
        todo = [i for i, n in enumerate(out) if n >= 0]
        errs = self._c.batch_get_into([keys[i] for i in todo], [[(ptrs[i], out[i])] for i in todo])
        copy = {i for i, err in zip(todo, errs) if isinstance(err, BufferNotRegistered) and _plausible(ptrs[i], out[i])}
        for i, err in zip(todo, errs):
            if err is not None and i not in copy:
                out[i] = code_of(err)
        self._copy_into(keys, ptrs, caps, sorted(copy), out)
        return out

    def _copy_into(self, keys: list[str], ptrs: list[int], caps: list[int], idx: list[int], out: list[int]) -> None:
        """get_into of memory that was never registered: read through the staging buffer, then copy (as Mooncake
        does over TCP). Sets ``out[i]`` to the bytes copied or a code."""
        if idx:
            for i, value in zip(idx, self._c.batch_get([keys[i] for i in idx])):
                out[i] = code_of(value) if isinstance(value, StoreError) else _copy_out(ptrs[i], value, caps[i])

    # ---- metadata ----------------------------------------------------------------------------------
    @pybind
    def is_exist(self, key: str, /) -> int:
        """1 if ``key`` is stored, 0 if not, -1 on error."""
        return self.batch_is_exist([key])[0]

    @pybind
    @guard(on_error=lambda err, keys=(), *_: [-1] * len(keys))
    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """Per key 1 (stored), 0 (not), -1 (error); one RPC."""
        return [1 if e else 0 for e in self._c.batch_exists(list(keys))]

    @pybind
    @guard()
    def get_size(self, key: str, /) -> int:
        """The size in bytes of object ``key``, or a negative code (OBJECT_NOT_FOUND)."""
        return self._sizes([key])[0]

    @pybind
    @guard()
    def remove(self, key: str, force: bool = False) -> int:
        """Remove ``key``: 0, OBJECT_NOT_FOUND, or OBJECT_HAS_LEASE while a read lease runs (unless ``force``;
        even then the reader's bytes stay valid until its lease ends)."""
        [result] = replies.outcomes(self._call("remove_checked", [key], {"force": bool(force)}), "remove_checked")
        return {"removed": OK, "leased": OBJECT_HAS_LEASE}.get(result, OBJECT_NOT_FOUND)

    @pybind
    @guard()
    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove every object whose key matches ``regex_pattern`` (Python ``re.search``), leased ones only with
        ``force``. The number removed, or INVALID_PARAMS for a pattern that does not compile."""
        return self._count("remove_by_regex", [regex_pattern], force)

    @pybind
    @guard()
    def remove_all(self, force: bool = False) -> int:
        """Remove every object (leased ones only with ``force``). The number removed, or a negative code."""
        return self._count("remove_all", [], force)

    # ---- internals ---------------------------------------------------------------------------------
    @property
    def _c(self) -> StoreClient:
        if self._client is None:
            raise StoreError("MooncakeDistributedStore: call setup(...) first")
        return self._client

    @property
    def _cb(self) -> StoreClient:
        """The client, for the bytes API (copies through the local buffer): refused without one."""
        if not self._bytes_api:
            raise ConfigError(
                "setup(local_buffer_size=0): the bytes API (put, get, tensors) needs a local buffer; "
                "use put_from/get_into, or set local_buffer_size > 0"
            )
        return self._c

    def _put_cfg(self, config: ReplicateConfig) -> PutConfig | None:
        from kvplugins.store.placement import from_client

        return None if config is DEFAULT else config.to_put_config(from_client(self._c.cfg))

    def _call(self, op: str, entries: list[object], opts: dict[str, object] | None = None) -> object:
        """One master op (the admin ops of store/master/admin_ops.py), as the role it needs: its payload, to be
        decoded by store/wire/replies.py."""
        payload: object = self._c.master_call(op, entries, opts)
        return payload

    def _sizes(self, keys: list[str]) -> list[int]:
        found = replies.sizes(self._call("get_size", list(keys)))
        return [OBJECT_NOT_FOUND if size is None else size for size in found]

    def _count(self, op: str, entries: list[object], force: bool) -> int:
        return replies.count(self._call(op, entries, {"force": bool(force)}), op)


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


def _first_code(errors: Iterable[BaseException | None]) -> int:
    return next((code_of(e) for e in errors if e is not None), OK)


SETUP_SIGNATURE = inspect.signature(MooncakeDistributedStore._setup).replace(
    parameters=list(inspect.signature(MooncakeDistributedStore._setup).parameters.values())[1:]
)  # Mooncake's setup form without self, as pybind11 prints it
SETUP_CASTS: dict[str, checks.Convert | checks.ConvertEach] = {}  # _setup's own pybind check converts
setattr(MooncakeDistributedStore.setup, "__signature__", SETUP_SIGNATURE)  # help() and inspect show that form


SETUP_KEYS = (
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
    "enable_ssd_offload",
    "ssd_offload_path",
    "tenant_id",
    "enable_client_http_server",
    "client_http_port",
)


def _setup_kwargs(config: dict[str, object]) -> dict[str, object]:
    """Mooncake's dict form of setup -> keyword arguments (ipc_socket_path is accepted and ignored); sizes may be
    strings as Mooncake's parser reads them (checks.byte_size)."""
    unknown = set(config) - set(SETUP_KEYS) - {"ipc_socket_path"}
    if unknown or "local_hostname" not in config:
        raise ConfigError(f"setup dict: unknown keys {sorted(unknown)} or no local_hostname; valid: {SETUP_KEYS}")
    out: dict[str, object] = {
        "metadata_server": "",
        "global_segment_size": 16 << 20,
        "local_buffer_size": 16 << 20,
        "protocol": "tcp",
        "rdma_devices": "",
        "master_server_addr": "",
    }
    out.update((k, v) for k, v in config.items() if k in SETUP_KEYS)
    for name in ("global_segment_size", "local_buffer_size"):
        if isinstance(size := out[name], str):
            out[name] = checks.byte_size(name, size)
    return out


def _warn_ignored(engine: object, ssd: bool, tenant: str, http: bool) -> None:
    for cond, what in (
        (engine is not None, "engine: our client runs its own transfer engine"),
        (ssd, "enable_ssd_offload: the disk tier lives on store nodes (--disk-dir)"),
        (tenant != "default", f"tenant_id {tenant!r}: one namespace per master"),
        (http, "enable_client_http_server: metrics are on the master and nodes (--metrics-port)"),
    ):
        if cond:
            log.warning("MooncakeDistributedStore.setup: %s", what)
