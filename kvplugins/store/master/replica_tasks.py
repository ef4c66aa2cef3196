"""Replica copy and move tasks: the master side of Mooncake 0.3.13's ``create_copy_task`` / ``create_move_task`` /
``query_task`` (semantics of its MasterService::CreateCopyTask/CreateMoveTask/QueryTask and Client::Copy/Move,
mooncake-store/src/master_service.cpp and client_service.cpp, read at upstream HEAD 3b5a594; not code).

Lifecycle of one task, in call order:
  ``task_create`` [[kind, key, source, targets]] validates as Mooncake does and answers [OK, task id] at once
  (the id is Mooncake's UUID: two unsigned 64-bit ints). A copy picks a source replica (one held by a process
  with a command link, see below); a move names it. The task is PENDING.
  ``advance`` (on create, each poll and each sweep) takes the next target: a target that already holds a replica
  is skipped (Mooncake: success); otherwise space is allocated on that target segment only (evicting only its
  own LRU objects, never elsewhere; a draining target fails the task), and the source's process gets a ``migrate``
  command with a flight id (the drain's: it writes the bytes through the transfer core, disk/worker.py) and the
  task is PROCESSING. One flight per key: a task waits while another flight (offload, drain) of its key runs,
  at most WAIT_S. A source node has at most MAX_FLIGHTS migrations (drain and tasks) in flight; further tasks
  wait their turn.
  ``migrated`` (the node's ``tier_done`` carrying that flight id; a late report of an ended flight matches
  nothing): a copy adds the new replica; a move switches the source replica to the target (the old bytes are
  freed when the last reader's lease ends, as a drain does). After the last target the task is SUCCESS. A failed
  write, a source replica dropped meanwhile (found corrupt, evicted), a lost flight (timeout, the object removed,
  a segment gone) or a target with no room makes it FAILED with the reason in ``message``; the destination of a
  failed write is freed after put_timeout_ms (bytes of a timed-out write may still land). A command is handed
  out with a TTL that ends TTL_MARGIN_S before its flight's deadline; the node does not start it later.
  ``task_query`` [[hi, lo]] answers [OK, [hi, lo, type, status, created ms, updated ms, assigned segment,
  message]] or [NOT_FOUND, None] (Mooncake: TASK_NOT_FOUND). Finished tasks are kept for FINISHED_KEPT tasks.

Who copies: Mooncake hands the task to the client that owns the source segment; here the process behind the
source segment runs it: a `kvplugins store` node, or a client that contributes a segment (both run a NodeTier
command link).

HA (issue #30): each task is journaled when it is created, starts a write and finishes (Journal.task_changed),
so a new leader answers ``task_query`` for every task the old one knew (ha/recovery.restore_tasks). A task the
old leader was running ends on the new one (``failed_over``): SUCCESS if its targets hold their replicas
already, else FAILED saying so (the targets done stay done; create it again for the rest), and the destination
of its write in flight is held for put_timeout_ms, so no put lands where the old leader's node may still write.

Internal tasks (``create(..., internal=True)``: the master's own re-replication, repair.py) are not journaled and
not kept once finished: nobody holds their id to query, and the destination of their write in flight is held by
a new leader anyway (tiering journals every flight). A node removed with 45,000 objects makes 45,000 of them;
journaled, a new leader spent 30 s ending them one etcd write each before it served.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvplugins.store.master.disk_state import FLIGHT_TIMEOUT_S, MAX_FLIGHTS, Flight, Frozen
from kvplugins.store.wire.protocol import NOT_NOW, INVALID, NOT_FOUND, OK

FINISHED_KEPT = 10_000  # finished tasks a master remembers for task_query (oldest forgotten first)
WAIT_S = 2 * FLIGHT_TIMEOUT_S  # a task still waiting for its key's other flight (offload, drain) after this fails
KINDS = {"copy": "REPLICA_COPY", "move": "REPLICA_MOVE"}


@dataclass
class Task:
    id: tuple[int, int]
    kind: str  # "copy" | "move"
    key: str
    obj: object  # metadata.Object the task was created for (dead once the key leaves the table)
    source: str  # segment whose process writes the bytes
    targets: list[str]  # targets not yet done, in order
    status: str = "PENDING"  # PENDING | PROCESSING | SUCCESS | FAILED (Mooncake's TaskStatus names)
    created_ms: int = field(default_factory=lambda: _wall_ms())
    updated_ms: int = 0
    message: str = ""
    flight: Flight | None = None
    internal: bool = False  # the master's own (repair.py): not journaled, forgotten when finished
    waiting_since: float | None = None  # master clock: since when it waits for another flight of its key
    src_off: int = -1  # the source replica's offset when its write started (checked at the report)

    def row(self) -> list:
        return [
            *self.id,
            KINDS[self.kind],
            self.status,
            self.created_ms,
            self.updated_ms or self.created_ms,
            self.source,
            self.message,
        ]


class ReplicaTasks:
    """The master's copy/move tasks; Tiering owns one (``tier.tasks``) and calls advance/migrated/tick."""

    def __init__(self, tier):
        self.tier = tier
        self.active: dict[tuple[int, int], Task] = {}
        self.by_fid: dict[int, Task] = {}  # flight id -> the task whose write it is
        self.finished: OrderedDict[tuple[int, int], Task] = OrderedDict()

    # ---- ops -----------------------------------------------------------------------------------------
    def op_task_create(self, entries, opts, now):
        return [self.create(kind, key, source, list(targets), now) for kind, key, source, targets in entries]

    def create(self, kind: str, key: str, source: str, targets: list[str], now: float, internal: bool = False) -> list:
        """Validate and start one task; [OK, [hi, lo]] or [code, reason] (see ``_check``). ``internal``: the
        master's own (not journaled, forgotten when finished)."""
        checked = self._check(kind, key, source, targets)
        if isinstance(checked, list):
            return checked
        obj, source = checked
        u = uuid.uuid4().int
        task = Task((u >> 64, u & (2**64 - 1)), kind, key, obj, source, list(dict.fromkeys(targets)))
        task.internal = internal
        self.active[task.id] = task
        self.advance(task, now)
        if task.id in self.active:
            self._journal(task)
        return [OK, list(task.id)]

    def op_task_query(self, entries, opts, now):
        out = []
        for hi, lo in entries:
            task = self.active.get((hi, lo)) or self.finished.get((hi, lo))
            out.append([OK, task.row()] if task else [NOT_FOUND, None])
        return out

    def _check(self, kind: str, key: str, source: str, targets: list[str]):
        """(object, source segment) of a valid request, else its answer [code, reason] (Mooncake's checks, in its
        order: INVALID ~ INVALID_PARAMS, NOT_FOUND ~ OBJECT_NOT_FOUND, NOT_NOW ~ UNAVAILABLE_IN_CURRENT_STATUS)."""
        svc = self.tier.service
        if not targets:
            return [INVALID, "no target segment given"]
        obj = svc.table.get(key)
        if obj is None or not obj.complete:
            return [NOT_FOUND, f"{key} is not stored"]
        if kind == "move" and source == targets[0]:
            return [INVALID, f"source and target are the same segment {source}"]
        for name in targets:
            seg = svc.segments.get(name)
            if seg is None:
                return [INVALID, f"target {name} is not a registered segment; see `kvplugins status`"]
            if isinstance(seg.allocator, Frozen):
                return [NOT_NOW, f"target {name} is draining"]
        held = [n for n, _ in obj.replicas]
        if kind == "move":
            if source not in held:
                return [INVALID, f"{key} has no replica on {source} (its replicas: {held})"]
            runnable = [source] if source in self.tier.nodes else []
        else:
            runnable = [n for n in held if n in self.tier.nodes]
        if not runnable:
            return [
                NOT_NOW,
                f"no replica of {key} is on a segment with a command link ({held}): its process "
                "is not a `kvplugins store` node or a client contributing a segment",
            ]
        return obj, random.choice(runnable)

    # ---- progress ------------------------------------------------------------------------------------
    def advance(self, task: Task, now: float, busy: Counter | None = None) -> None:
        """Start the task's next target, or finish it. Called with no flight of the task in the air. ``busy``:
        migrate flights per source node (counted here when None); a source with MAX_FLIGHTS waits (FIFO)."""
        svc, tier = self.tier.service, self.tier
        while task.targets:
            if svc.table.get(task.key) != task.obj:
                return self._finish(task, "FAILED", f"{task.key} was removed")
            held = {n for n, _ in task.obj.replicas}
            if task.source not in held or task.source not in tier.nodes:
                return self._finish(task, "FAILED", f"the source replica on {task.source} is gone")
            target = task.targets[0]
            if target in held:  # Mooncake: the target already has it, success
                task.targets.pop(0)
                if task.kind == "move":
                    self._drop_source(task, now)
                continue
            if task.key in tier.flights:  # an offload or drain of the key: wait for it (tick retries)
                task.waiting_since = task.waiting_since or now
                if now - task.waiting_since > WAIT_S:
                    return self._finish(task, "FAILED", f"{task.key} was busy (offload or drain) for {WAIT_S:g} s")
                return
            if (busy[task.source] if busy is not None else tier.migrating(task.source)) >= MAX_FLIGHTS:
                return  # the source's process has enough to write: wait (FIFO)
            seg = svc.segments.get(target)
            if seg is None:
                return self._finish(task, "FAILED", f"target {target} left the pool")
            if isinstance(seg.allocator, Frozen):
                return self._finish(task, "FAILED", f"target {target} is draining")
            return self._start(task, seg, now, busy)
        self._finish(task, "SUCCESS", "")

    def _start(self, task: Task, seg, now: float, busy: Counter | None) -> None:
        """Allocate on the target only, evicting only the target's own LRU objects (never elsewhere), and queue
        the write."""
        off = self.tier.alloc_on(seg, seg.allocator, task.obj.size, now)
        if off is None:
            return self._finish(
                task,
                "FAILED",
                f"no room on {seg.name} for {task.obj.size} bytes (everything there "
                "is leased, pinned, pending or within the eviction grace)",
            )
        task.waiting_since, task.src_off = None, dict(task.obj.replicas)[task.source]
        task.flight = self.tier.migrate(task.obj, task.source, seg, off, now)
        self.by_fid[task.flight.fid] = task
        if busy is not None:
            busy[task.source] += 1
        task.status, task.updated_ms = "PROCESSING", _wall_ms()
        self._journal(task)

    def migrated(self, task: Task, ok: bool, detail, now: float) -> None:
        """The source's process reported the write of the task's current target (its flight id matched)."""
        tier, svc, obj = self.tier, self.tier.service, task.obj
        flight, task.flight = task.flight, None
        self.by_fid.pop(flight.fid, None)
        dest, off = flight.dest
        grace = now + svc.cfg.put_timeout_ms / 1000  # a timed-out write may still land: its space waits
        if not ok or svc.segments.get(dest.name) is not dest:
            tier.end_flight(task.key, now, free_dest_at=grace)
            return self._finish(task, "FAILED", f"writing to {dest.name} failed: {detail}")
        if (task.source, task.src_off) not in obj.replicas:  # dropped (corrupt, evicted to disk) meanwhile
            tier.end_flight(task.key, now, free_dest_at=grace)
            return self._finish(task, "FAILED", f"the source replica on {task.source} changed during the copy")
        tier.end_flight(task.key, now)  # its destination becomes a replica (journal: flight ended)
        obj.replicas = obj.replicas + [(dest.name, off)]
        task.targets.pop(0)
        if task.kind == "move":
            self._drop_source(task, now)
        svc.journal.replicas_changed([obj])
        self.advance(task, now)

    def _drop_source(self, task: Task, now: float) -> None:
        svc, obj = self.tier.service, task.obj
        old = [(svc.segments.get(n), o) for n, o in obj.replicas if n == task.source]
        obj.replicas = [(n, o) for n, o in obj.replicas if n != task.source]
        self.tier.free_at(old, max(now, obj.lease_until), now)  # readers that got the old location keep it
        svc.journal.replicas_changed([obj])

    def tick(self, now: float) -> None:
        """A task whose flight was ended by someone else (timeout, removal, segment loss) fails; a waiting one is
        retried."""
        busy = Counter(f.segment for f in self.tier.flights.values() if f.kind == "migrate")
        for task in list(self.active.values()):
            if task.flight is not None and self.tier.flights.get(task.key) is not task.flight:
                self.by_fid.pop(task.flight.fid, None)
                task.flight = None
                self._finish(
                    task,
                    "FAILED",
                    f"the write to {task.targets[0]} did not complete (timed out, the "
                    "object was removed or a segment left)",
                )
            elif task.flight is None:
                self.advance(task, now, busy)

    def failed_over(self, task: Task) -> None:
        """A task the previous HA leader was running (ha/recovery.restore_tasks): its write in flight cannot be
        followed here, so it ends now: SUCCESS if every target it had left holds a replica already (a move: and
        its source none), else FAILED naming the failover."""
        obj = self.tier.service.table.get(task.key)
        held = {n for n, _ in obj.replicas} if obj is not None and obj.complete else set()
        if held and all(t in held for t in task.targets) and (task.kind == "copy" or task.source not in held):
            return self._finish(task, "SUCCESS", "")
        self._finish(
            task,
            "FAILED",
            "the master failed over while this task ran (targets it had finished keep "
            f"their replicas); create it again for {task.targets}",
        )

    def remember(self, task: Task) -> None:
        """A finished task of the previous HA leader (ha/recovery.restore_tasks), for task_query."""
        self.finished[task.id] = task
        self._trim()

    def _finish(self, task: Task, status: str, message: str) -> None:
        task.status, task.message, task.updated_ms = status, message, _wall_ms()
        self.active.pop(task.id, None)
        task.obj = None
        if task.internal:
            return
        self.finished[task.id] = task
        self._journal(task)
        self._trim()

    def _journal(self, task: Task) -> None:
        if not task.internal:
            self.tier.service.journal.task_changed(task)

    def _trim(self) -> None:
        while len(self.finished) > FINISHED_KEPT:
            self.tier.service.journal.task_forgotten(self.finished.popitem(last=False)[0])


def _wall_ms() -> int:
    return int(time.time() * 1000)
