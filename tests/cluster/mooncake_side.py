"""Mooncake's side of a cluster run: the real Mooncake 0.3.13 wheel (``mooncake.store``) and its ``mooncake_master``
under the same fault schedule as kvplugins.

* ``MooncakeStore``: the workload ``Store`` (workload.py) over ``MooncakeDistributedStore``, as an engine host's
  client that contributes no segment.
* ``master_command``: the ``mooncake_master`` argv for one host (its RPC, HTTP metadata and metrics servers bind
  that host's address), with the lease and liveness settings that decide what a fault does.
* ``python -m tests.cluster.mooncake_side replay TRACE --master MASTER --host-ip IP [kvplugins replay's flags]``:
  the trace replay (kvplugins/replay) with ``ReplayClient``, Mooncake's client, as the pool.
* ``python -m tests.cluster.mooncake_side node ...``: a store node, a process that only contributes a segment (the
  equivalent of a ``kvplugins store`` node)::

      python -m tests.cluster.mooncake_side node --master MASTER --host-ip 10.99.0.3 --segment-size 268435456 \
          --ready-file DIR/n3.ready

The master string. A kvplugins master is one address; Mooncake needs two, its master's RPC address and the HTTP
metadata server (which the master embeds), so here ``master`` is ``"<master_ip>:<rpc_port>|<metadata_url>"``, e.g.
``"10.99.0.2:50051|http://10.99.0.2:8080/metadata"`` (``master_address`` builds it, ``parse_master`` splits it).
With Mooncake's HA masters (``master_command(..., etcd_endpoints=)``: two or more masters elect a leader in etcd,
its address kept under MASTER_VIEW_KEY), clients find the leader through etcd and the transfer engines exchange
their metadata peer to peer, so nothing runs on one master's host alone:
``"etcd://10.99.0.1:2379;10.99.0.2:2379|P2PHANDSHAKE"`` (``ha_master_address``).

What Mooncake 0.3.13 does (read from its source, seen against the real wheel in test_mooncake_side.py):

* A miss and an error look the same to ``get_batch``: every key that could not be read, for whatever reason
  (absent, its replica's segment dead, a transfer failure, the master unreachable), comes back as ``b""``; it never
  raises for a key. When the whole batch fails before any key is looked at it returns the one-element list
  ``[b""]`` whatever the number of keys. ``MooncakeStore.batch_get`` therefore asks ``batch_is_exist`` about every
  key that came back empty: 0 means a miss (None), 1 an error (the object exists but could not be read), a negative
  entry (a Mooncake error code) an error. The probe is a second RPC, so the verdict is racy: an object removed or
  unmounted between the two calls reads as a miss. Empty values would read as misses too (the workload never
  stores one).
* ``batch_is_exist`` gives per key 1, 0 or a negative error code (not only -1); ``exists_prefix`` raises on a
  negative entry.
* ``put_batch`` returns one int: 0, or the code of the first key that failed (others may have been stored). Putting
  an existing key is success (Mooncake maps OBJECT_ALREADY_EXISTS to OK). So a failed batch is an error (an
  indeterminate put) for every one of its keys.
* A SIGKILLed store node (test_mooncake_side.py has the details): its segment stays mounted until the master's
  ``--client_ttl`` (10 s) expires; until then reads of objects whose first replica is there fail (no failover to
  the second replica), exists still says 1, and puts with 2 replicas fail whole (TRANSFER_FAIL). After the unmount
  the surviving replicas serve, and a 2-replica put silently stores 1.
* ``setup`` against an unreachable master retries ``MC_STORE_CLIENT_SETUP_RETRIES`` times (default 20, about
  4.6 s each) before it fails: opening a store or a node during a partition blocks for about 90 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from kvplugins.config import add_arguments
from kvplugins.errors import KeyNotFound, StoreError
from kvplugins.replay.config import ReplayConfig

LOCAL_BUFFER = 64 << 20  # the client's registered buffer: a batch of 6 pages of 4 MiB is staged in it whole
NODE_BUFFER = 16 << 20  # a store node reads and writes nothing itself

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that a cluster run can meet, for readable errors
ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -710: "REPLICA_NOT_FOUND",
    -711: "REPLICA_ALREADY_EXISTS",
    -712: "REPLICA_IS_GONE",
    -714: "OBJECT_REPLICA_BUSY",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}


class MooncakeError(Exception):
    """A Mooncake call's failure: the operation and Mooncake's error code (with its name where known)."""

    def __init__(self, op: str, code: int | None, detail: str = ""):
        self.op, self.code = op, code
        what = f"code {code} ({ERROR_NAMES.get(code, 'unknown')})" if code is not None else "failed"
        super().__init__(f"mooncake {op}: {what}" + (f": {detail}" if detail else ""))


def master_address(host_ip: str, rpc_port: int, metadata_port: int) -> str:
    """The master string of a master started by ``master_command(host_ip, rpc_port, metadata_port, ...)``."""
    return f"{host_ip}:{rpc_port}|http://{host_ip}:{metadata_port}/metadata"


def ha_master_address(etcd_endpoints: str) -> str:
    """The master string of HA masters started with ``master_command(..., etcd_endpoints=etcd_endpoints)``
    (``"ip:port;ip:port"``, Mooncake's separator)."""
    return f"etcd://{etcd_endpoints}|P2PHANDSHAKE"


def parse_master(master: str) -> tuple[str, str]:
    """``"<ip>:<rpc_port>|<metadata_url>"`` or ``"etcd://<endpoints>|P2PHANDSHAKE"`` -> (what Mooncake's client
    takes as its master address, the transfer engine's metadata server)."""
    rpc, sep, metadata = master.partition("|")
    ha = rpc.startswith("etcd://") and metadata == "P2PHANDSHAKE"
    if not sep or ":" not in rpc or not (ha or metadata.startswith("http")):
        raise ValueError(
            f"mooncake master {master!r} is not '<ip>:<rpc_port>|http://<ip>:<port>/metadata' "
            "or 'etcd://<ip>:<port>[;...]|P2PHANDSHAKE'"
        )
    return rpc, metadata


def master_binary() -> str:
    """The wheel's ``mooncake_master`` (beside this interpreter, else on PATH)."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.exists():
        return str(beside)
    found = shutil.which("mooncake_master")
    if found is None:
        raise FileNotFoundError("mooncake_master is neither beside the interpreter nor on PATH")
    return found


def master_command(
    host_ip: str,
    rpc_port: int,
    metadata_port: int,
    metrics_port: int,
    *,
    client_ttl_s: int = 10,
    kv_lease_ttl_ms: int = 10_000,
    kv_soft_pin_ttl_ms: int = 1_800_000,
    put_start_discard_timeout_s: int = 30,
    put_start_release_timeout_s: int = 600,
    eviction_high_watermark_ratio: float = 0.9,
    eviction_ratio: float = 0.05,
    metadata_cleanup_on_timeout: bool = False,
    etcd_endpoints: str = "",
    oplog: bool = True,
    binary: str | None = None,
) -> list[str]:
    """The argv of a ``mooncake_master`` whose RPC, HTTP metadata and metrics servers bind ``host_ip``; with
    ``etcd_endpoints`` (``"ip:port;ip:port"``) an HA master (``--enable_ha``: it elects itself leader in etcd
    or waits as a standby) and no HTTP metadata server (clients use P2PHANDSHAKE: ``ha_master_address``);
    ``oplog`` (``--enable_oplog``, off in Mooncake by default, on here): the leader's object metadata reaches the
    standby through Mooncake's batch-record OpLog (without it a new leader starts with no objects).

    The settings that decide what a fault does, each at Mooncake 0.3.13's own default (``mooncake_master --help``)
    unless a caller changes it, and always passed explicitly so the argv documents the run:

    * ``client_ttl_s`` (``--client_ttl``, 10): seconds a client (a store node or an engine client) stays alive
      after its last heartbeat; then the master treats it as gone and unmounts its segments, dropping the replicas
      in them.
    * ``kv_lease_ttl_ms`` (``--default_kv_lease_ttl``, 10000): the lease a read takes on an object; a leased object
      is neither removed nor evicted.
    * ``kv_soft_pin_ttl_ms`` (``--default_kv_soft_pin_ttl``, 1800000): soft pins (the workload pins nothing).
    * ``put_start_discard_timeout_s`` (``--put_start_discard_timeout_sec``, 30) and ``put_start_release_timeout_s``
      (``--put_start_release_timeout_sec``, 600): when a put begun (PutStart) but never ended (a client killed
      mid-put) is discarded, and when the space it reserved is released.
    * ``eviction_high_watermark_ratio`` (0.9) and ``eviction_ratio`` (0.05): when memory pressure evicts objects.
    * ``metadata_cleanup_on_timeout`` (``--enable_metadata_cleanup_on_timeout``, false): whether a timed-out
      client's transfer-engine entries are also removed from the HTTP metadata server.

    Snapshots and offload stay off (Mooncake's defaults); metric reporting (log lines) is off.
    """
    if etcd_endpoints:
        where = ["--enable_ha=true", f"--etcd_endpoints={etcd_endpoints}", f"--enable_oplog={str(oplog).lower()}"]
    else:
        where = [
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={host_ip}",
            f"--http_metadata_server_port={metadata_port}",
        ]
    return [
        binary or master_binary(),
        f"--rpc_address={host_ip}",
        f"--rpc_port={rpc_port}",
        *where,
        f"--metrics_host={host_ip}",
        f"--metrics_port={metrics_port}",
        "--enable_metric_reporting=false",
        f"--client_ttl={client_ttl_s}",
        f"--default_kv_lease_ttl={kv_lease_ttl_ms}",
        f"--default_kv_soft_pin_ttl={kv_soft_pin_ttl_ms}",
        f"--put_start_discard_timeout_sec={put_start_discard_timeout_s}",
        f"--put_start_release_timeout_sec={put_start_release_timeout_s}",
        f"--eviction_high_watermark_ratio={eviction_high_watermark_ratio}",
        f"--eviction_ratio={eviction_ratio}",
        f"--enable_metadata_cleanup_on_timeout={'true' if metadata_cleanup_on_timeout else 'false'}",
    ]


def _open(master: str, host_ip: str, segment_size: int, buffer_size: int):
    """A set-up MooncakeDistributedStore on ``host_ip`` (its transfer engine binds it: MC_TCP_BIND_ADDRESS, which
    Mooncake reads at setup; otherwise it takes the first LAN address it finds)."""
    from mooncake.store import MooncakeDistributedStore

    rpc, metadata = parse_master(master)
    os.environ["MC_TCP_BIND_ADDRESS"] = host_ip
    store = MooncakeDistributedStore()
    rc = store.setup(host_ip, metadata, segment_size, buffer_size, "tcp", "", rpc)
    if rc != 0:
        store.close()
        raise MooncakeError("setup", rc, f"master {master}")
    return store


class MooncakeStore:
    """Mooncake's client as a workload ``Store``: an engine host's client on ``host_ip`` that contributes no
    segment (global_segment_size 0) and stages batches in a ``LOCAL_BUFFER`` local buffer; puts ``replicas``
    replicas. ``master``: ``"<ip>:<rpc_port>|<metadata_url>"`` (module docstring)."""

    def __init__(self, master: str, host_ip: str, replicas: int, local_buffer_size: int = LOCAL_BUFFER):
        from mooncake.store import ReplicateConfig

        self._s = _open(master, host_ip, 0, local_buffer_size)
        self._cfg = ReplicateConfig()
        self._cfg.replica_num = replicas

    def exists_prefix(self, keys: list[str]) -> int:
        """How many leading keys exist (Mooncake has no prefix op: one ``batch_is_exist`` over all of them).
        Raises MooncakeError if any entry is an error code."""
        if not keys:
            return 0
        got = self._s.batch_is_exist(keys)
        if len(got) != len(keys):
            raise MooncakeError("batch_is_exist", None, f"{len(got)} results for {len(keys)} keys")
        bad = [c for c in got if c < 0]
        if bad:
            raise MooncakeError("batch_is_exist", bad[0])
        n = 0
        while n < len(got) and got[n] == 1:
            n += 1
        return n

    def batch_get(self, keys: list[str]) -> list[bytes | None | Exception]:
        """Per key: the bytes, None for a miss, or a MooncakeError.

        ``get_batch`` answers ``b""`` for a miss and for an error alike (and ``[b""]`` for a batch that failed
        whole); each key that came back empty is then probed with ``batch_is_exist``: 0 -> None (a miss), 1 -> an
        error (it exists but could not be read), a negative code -> an error naming it. If the probe itself raises,
        every empty key is an error."""
        if not keys:
            return []
        got = self._s.get_batch(keys)
        out: list[bytes | None | Exception] = list(got) if len(got) == len(keys) else [b""] * len(keys)
        empty = [i for i, v in enumerate(out) if not v]
        if not empty:
            return out
        try:
            probe = self._s.batch_is_exist([keys[i] for i in empty])
            if len(probe) != len(empty):
                raise MooncakeError("batch_is_exist", None, f"{len(probe)} results for {len(empty)} keys")
        except Exception as e:  # noqa: BLE001 - the keys' verdict is an error either way
            for i in empty:
                out[i] = MooncakeError("get_batch", None, f"no bytes, and the existence probe failed: {e!r}")
            return out
        for i, code in zip(empty, probe):
            if code == 0:
                out[i] = None
            elif code == 1:
                out[i] = MooncakeError("get_batch", None, "no bytes, but batch_is_exist says the object exists")
            else:
                out[i] = MooncakeError("get_batch", code, "no bytes; batch_is_exist failed")
        return out

    def batch_put(self, keys: list[str], values: list[bytes]) -> list[Exception | None]:
        """``put_batch`` with ``replicas`` replicas: all None, or (it gives one code for the batch, that of the
        first key that failed) the same MooncakeError for every key."""
        if not keys:
            return []
        rc = self._s.put_batch(keys, values, self._cfg)
        if rc == 0:
            return [None] * len(keys)
        err = MooncakeError("put_batch", rc)
        return [err] * len(keys)

    def transfer_stats(self) -> dict:
        """Mooncake exposes no transfer counters a client can read from Python (its client metrics are log
        lines / an optional HTTP endpoint): always ``{}``."""
        return {}

    def close(self) -> None:
        if self._s is not None:
            self._s.close()
            self._s = None


class ReplayClient:
    """A MooncakeStore as the trace replay's pool client (kvplugins/replay/pool.py PoolOps): a miss is KeyNotFound,
    any Mooncake failure a StoreError, so the replay counts them as kvplugins' client's (``--miss-on-store-error``:
    a request whose lookup failed is served as a miss)."""

    def __init__(self, store: MooncakeStore):
        self._s = store

    def batch_exists_prefix(self, keys: list[str]) -> int:
        try:
            return self._s.exists_prefix(keys)
        except MooncakeError as e:
            raise StoreError(str(e)) from None

    def batch_get(self, keys: list[str]) -> list:
        try:
            got = self._s.batch_get(keys)
        except Exception as e:  # noqa: BLE001 - Mooncake's binding may raise anything: every key failed
            return [StoreError(f"{k}: get_batch raised {e!r}") for k in keys]
        return [
            KeyNotFound(k) if v is None else StoreError(f"{k}: {v}") if isinstance(v, Exception) else v
            for k, v in zip(keys, got)
        ]

    def batch_put(self, keys: list[str], values: list[bytes]) -> list:
        return self._s.batch_put(keys, values)

    def close(self) -> None:
        self._s.close()


def replay(args) -> int:
    """``kvplugins replay`` with Mooncake's client as the pool (the same flags, ReplayConfig, plus --host-ip and
    --replicas); exits 1 on a wrong byte, as it does."""
    from kvplugins.config import from_args
    from kvplugins.replay.plan import execute

    def make_client(master: str) -> ReplayClient:
        return ReplayClient(MooncakeStore(master, args.host_ip, args.replicas))

    rows = execute(from_args(ReplayConfig, args), args.trace, lambda s: print(s, flush=True), make_client)
    return 1 if any(r["wrong_bytes"] for r in rows) else 0


def node(master: str, host_ip: str, segment_size: int, ready_file: Path, buffer_size: int = NODE_BUFFER) -> int:
    """A store node: contribute a ``segment_size`` segment, write ``ready_file``, serve until SIGTERM/SIGINT,
    close, return 0. A failed setup prints Mooncake's code on stderr and returns it as an exit status: ``-code``
    capped at 255 (setup's usual failure, -1, exits 1)."""
    try:
        store = _open(master, host_ip, segment_size, buffer_size)
    except MooncakeError as e:
        print(e, file=sys.stderr, flush=True)
        return min(-e.code, 255) if e.code and e.code < 0 else 1
    stop = threading.Event()
    # after setup: Mooncake installs its own SIGINT/SIGTERM handlers when the store registers, these replace them
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ready_file.write_text(f"{os.getpid()}\n")
    while not stop.wait(1.0):
        pass
    store.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Mooncake's side of a cluster run")
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("node", help="a store node: contribute a segment until SIGTERM/SIGINT")
    n.add_argument("--master", required=True, help="<ip>:<rpc_port>|<metadata_url> or etcd://...|P2PHANDSHAKE")
    n.add_argument("--host-ip", required=True, help="this host's address (the transfer engine binds it)")
    n.add_argument("--segment-size", type=int, required=True, help="bytes of memory contributed")
    n.add_argument("--ready-file", type=Path, required=True, help="written once setup returned 0")
    n.add_argument("--buffer-size", type=int, default=NODE_BUFFER, help="the node's own local buffer")
    r = sub.add_parser("replay", help="kvplugins replay of a trace with Mooncake's client as the pool")
    r.add_argument("trace", nargs="?", help="FAST'25 or kvplugins JSONL trace (omit with --synth)")
    r.add_argument("--host-ip", required=True, help="this host's address (the transfer engine binds it)")
    r.add_argument("--replicas", type=int, default=2, help="replicas of each put")
    add_arguments(r, ReplayConfig)
    args = p.parse_args(argv)
    if args.cmd == "replay":
        sys.exit(replay(args))
    sys.exit(node(args.master, args.host_ip, args.segment_size, args.ready_file, args.buffer_size))


if __name__ == "__main__":
    main()
