"""NodeTier: a store node's link to the master's disk tier and drain (master/tiering.py, master/drain.py).

It announces the node (``tier_register``: promote endpoint, disk capacity, the objects already on disk), then
polls the master every ``disk_poll_ms`` on the raw endpoint (``tier_poll``) and runs the commands it gets, in
order: ``offload`` (write the object from this node's segment to a durable file), ``delete`` (a file nobody
needs), ``migrate`` (drain: write an object to another segment through the transfer core), ``exit`` (drained:
stop the node). Results go back in one ``tier_done`` per poll. Promote requests arrive on the promote endpoint
(server.py) and load files into this node's segment at master-allocated offsets (``promote_start`` /
``promote_commit``). Every node runs one, with or without a disk (drain needs it).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvplugins.errors import KeyNotFound, MasterUnreachable, StoreError, TransferError
from kvplugins.store.client.connect import master_client
from kvplugins.store.node.disk.files import CorruptFile, checksum
from kvplugins.store.node.disk.server import OpServer
from kvplugins.store.node.disk.store import DiskStore
from kvplugins.store.wire.protocol import NOT_FOUND, OK
from kvplugins.transfer import SegmentDescriptor
from kvplugins.transfer.staging import StagingPool

log = logging.getLogger(__name__)
ANNOUNCE_CHUNK = 20_000  # files per tier_register frame (~1.5 MB)


class NodeTier:
    """``segment``: the node's OwnedSegment; ``on_exit()``: called once the master says the drain is done."""

    def __init__(self, config, engine, segment, master: str, on_exit):
        self.cfg, self.engine, self.segment, self.on_exit = config, engine, segment, on_exit
        self.disk = DiskStore(config.disk_dir, config.disk_capacity) if config.disk_dir else None
        self.rpc = master_client(master, config.rpc_timeout_ms, "node")
        self.mem = engine.memoryview(segment.region)
        self._staging = StagingPool.registered(engine, 1 << 20)
        self._lock = threading.Lock()  # guards _lost (the disk store has its own lock)
        self._lost: list = []  # evicted/corrupt files to report
        self.server = (
            OpServer(config.host, {"promote": self.op_promote}, config.promote_limits(), config.promote_max_batch)
            if self.disk
            else None
        )
        self._pool = (
            ThreadPoolExecutor(config.disk_threads, thread_name_prefix="kvp-offload")
            if self.disk and config.disk_threads > 1
            else None
        )
        self._registered = False
        self._polled = 0.0  # monotonic time the last poll was sent (migrate TTLs count from it)
        self._stop = threading.Event()
        self._thread = None
        try:
            self._register()
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._loop, name="kvp-disk-tier", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self.server.address if self.server else ""

    def _register(self) -> None:
        """Announce this node and its files (in chunks of ANNOUNCE_CHUNK: one frame and one master step each)."""
        files = self.disk.entries() if self.disk else []
        capacity, stale = self.disk.capacity if self.disk else 0, []
        disk_id = self.disk.disk_id if self.disk else ""
        for i in range(0, max(len(files), 1), ANNOUNCE_CHUNK):
            chunk = [[self.segment.name, self.endpoint, capacity, files[i : i + ANNOUNCE_CHUNK], disk_id]]
            [(code, value)] = self.rpc.call("tier_register", chunk, {"more": 1} if i else {})
            if code != OK:
                raise StoreError(f"master refused the disk tier of {self.segment.name}: {value}")
            stale += value
        for key in stale:
            self.disk.delete(key)
        self._registered = True
        if self.disk:
            log.info(
                "disk tier of %s registered: %d files (%d stale deleted)", self.segment.name, len(files), len(stale)
            )
        else:
            log.info("command link of %s registered (drain, replica tasks; no disk tier)", self.segment.name)

    # ---- poll loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        down = False
        while not self._stop.wait(self.cfg.disk_poll_ms / 1000):
            try:
                if not self._registered:
                    self._register()
                self._poll_once()
                down = False
            except (MasterUnreachable, StoreError) as e:
                if not down:
                    log.warning("disk tier poll failed: %s", e)
                down, self._registered = True, isinstance(e, MasterUnreachable) and self._registered
            except Exception:  # noqa: BLE001 - a bug in one command must not stop offloads and drains for good
                log.exception("disk tier poll failed; polling goes on")

    def _poll_once(self) -> None:
        sent = time.monotonic()  # TTLs count from the request: its answer may have spent seconds on the wire
        [(code, value)] = self.rpc.call("tier_poll", [self.segment.name])
        if code == NOT_FOUND:
            self._registered = False
            return
        cmds, descs = value
        self._polled = sent
        done = [r for r in self._run_all(cmds, descs) if r is not None]
        with self._lock:
            done += self._lost
            self._lost = []
        if done:
            self.rpc.call("tier_done", done, {"segment": self.segment.name})
        if any(c[0] == "exit" for c in cmds):
            log.info("segment %s drained; the node leaves", self.segment.name)
            self._stop.set()
            self.on_exit()

    def _run_all(self, cmds: list, descs: dict) -> list:
        """Run ``cmds`` in order, except that consecutive offloads (distinct keys: the master keeps one flight
        per key) run on ``disk_threads`` threads at once, so their fsyncs overlap."""
        out, i = [], 0
        while i < len(cmds):
            j = i
            while j < len(cmds) and cmds[j][0] == "offload":
                j += 1
            if self._stop.is_set():  # closing: the rest fail (the master frees their space)
                out += [_refused(c, "the node is closing") for c in cmds[i:]]
                return out
            if j - i > 1 and self._pool is not None:
                out += list(self._pool.map(lambda c: self._offload(*c[1:]), cmds[i:j]))
            else:
                j = max(j, i + 1)
                out += [self._run(c, descs) for c in cmds[i:j]]
            i = j
        return out

    def _run(self, cmd: list, descs: dict):
        kind = cmd[0]
        if kind == "offload":
            return self._offload(*cmd[1:])
        if kind == "delete":
            if self.disk:
                self.disk.delete(cmd[1])
            return None
        if kind == "migrate":
            return self._migrate(*cmd[1:], descs)
        return None

    def _offload(self, key: str, off: int, size: int, expected: int):
        if self.disk is None:
            return ["offload", key, False, "this node has no disk tier", 0]
        data = self.mem[off : off + size]
        digest = checksum(data)
        if expected and digest != expected:
            return ["offload", key, False, "the DRAM copy fails its checksum", 0]
        try:
            evicted = self.disk.put(key, data, digest)
        except (OSError, StoreError) as e:
            log.warning("offload of %s failed: %s", key, e)
            return ["offload", key, False, str(e), 0]
        self._report_lost("evicted", evicted)
        return ["offload", key, True, digest, 0]

    def _left_ms(self, ttl_ms: float) -> float:
        """What is left of a command's ``ttl_ms`` (ms from when the poll that fetched it was sent: the master
        counted it from a moment after that, so this end is never later than the master's, however long the
        answer took to arrive; counted from the answer, a copy delayed by a cut landed after its space was
        given to another object)."""
        return ttl_ms - (time.monotonic() - self._polled) * 1000

    def _migrate(
        self, key: str, size: int, src: int, dest: str, region_id: int, off: int, fid: int, ttl_ms: float, descs: dict
    ):
        """Write object ``key`` (``src``: its offset in this segment, -1: from this node's disk) to ``dest`` at
        ``off``, unless more than ``ttl_ms`` passed since the poll (its flight is over: the space may be another
        object's by now); the write itself ends by then too (a node paused mid-write sends nothing more on
        resume). -> ["migrate", key, ok, detail, fid]."""
        expired = ["migrate", key, False, "expired before it ran", fid]
        if self._left_ms(ttl_ms) <= 0:
            return expired
        if dest not in descs:
            return ["migrate", key, False, f"no descriptor for {dest}", fid]
        try:
            with self._staging.slot(nbytes=size) as slot:
                base, view = slot.addr, self._staging.view(slot)
                if src >= 0:
                    addr = self.segment.region.addr + src
                else:
                    self.disk.read_into(key, view[:size])
                    addr = base
                left_ms = self._left_ms(ttl_ms)  # the write ends within the flight (the disk read took some)
                if left_ms <= 0:
                    return expired
                [err] = self.engine.write_spans(
                    SegmentDescriptor.from_wire(descs[dest]),
                    region_id,
                    [addr],
                    [off],
                    [size],
                    timeout_ms=min(float(self.cfg.rpc_timeout_ms), left_ms),
                    fenced=True,  # the destination's node drops it once late (its space may be reused then)
                )
        except KeyNotFound:
            return ["migrate", key, False, "missing", fid]
        except CorruptFile:
            return ["migrate", key, False, "corrupt", fid]
        except OSError as e:
            return ["migrate", key, False, f"disk read failed: {e}", fid]
        except TransferError as e:
            err = e
        return ["migrate", key, err is None, str(err) if err else None, fid]

    def _report_lost(self, kind: str, keys) -> None:
        if keys:
            with self._lock:
                self._lost += [[kind, k, False, None, 0] for k in keys]

    # ---- promote endpoint ----------------------------------------------------------------------------
    def op_promote(self, keys: list, opts: dict) -> list:
        """Load each disk-resident key into this node's segment. -> per key [code, detail] (OK, EXISTS: already
        in DRAM or another promotion runs, NOT_FOUND, STORE_FULL)."""
        started = self.rpc.call("promote_start", list(keys), {"segment": self.segment.name})
        out, commits = [], []
        for key, (code, value) in zip(keys, started):
            if code != OK:
                out.append([code, value])
                continue
            off, size = value
            try:
                self.disk.read_into(key, self.mem[off : off + size])
                commits.append([key, True, None])
                out.append([OK, None])
            except (KeyNotFound, CorruptFile, OSError) as e:
                commits.append([key, False, "corrupt" if isinstance(e, CorruptFile) else "missing"])
                out.append([NOT_FOUND, str(e)])
        if commits:
            self.rpc.call("promote_commit", commits, {"segment": self.segment.name})
        return out

    def stats(self) -> dict:
        return self.disk.stats() if self.disk else {}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and threading.current_thread() is not self._thread:  # a write may run
            self._thread.join(timeout=5 + 2 * self.cfg.rpc_timeout_ms / 1000)
        if self.server:
            self.server.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._staging.close()
        self.rpc.close()


def _refused(cmd: list, why: str):
    """The report of a command not run (None for those that need none)."""
    if cmd[0] == "migrate":
        return ["migrate", cmd[1], False, why, cmd[7]]
    if cmd[0] == "offload":
        return ["offload", cmd[1], False, why, 0]
    return None
