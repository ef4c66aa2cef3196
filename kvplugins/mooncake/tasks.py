"""Mooncake 0.3.13's replica tasks, a mixin of api.MooncakeDistributedStore: ``create_copy_task``,
``create_move_task``, ``query_task`` over the master's task ops (store/master/replica_tasks.py). Codes as a real
mooncake_master answered them (tests/store/test_mooncake_api.py, mooncake_tasks_script): a missing key -704, no target,
an unknown target or a move from a segment without the replica -600, an unknown task id -1400; a failed create
answers the id (0, 0). Segment names are the ``transport_endpoint`` of get_replica_desc (`kvplugins status`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvplugins.store.wire import protocol
from kvplugins.mooncake.codes import INVALID_PARAMS, OBJECT_NOT_FOUND, OK, guard, code_of, log, pybind

TASK_NOT_FOUND = -1400
UNAVAILABLE_IN_CURRENT_STATUS = -1010
UNAVAILABLE_IN_CURRENT_MODE = -1011
NO_TASK = (0, 0)
CODES = {
    protocol.NOT_FOUND: OBJECT_NOT_FOUND,
    protocol.INVALID: INVALID_PARAMS,
    protocol.NOT_NOW: UNAVAILABLE_IN_CURRENT_STATUS,
}


class TaskType(enum.IntEnum):
    """Mooncake's TaskType."""

    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    """Mooncake's TaskStatus."""

    PENDING = 0
    PROCESSING = 1
    SUCCESS = 2
    FAILED = 3


@dataclass(frozen=True)
class QueryTaskResponse:
    """Mooncake's QueryTaskResponse. ``assigned_client``: a UUID derived from ``assigned_segment``, the segment
    whose process runs the copy (Mooncake: the id of the client owning the source segment); times are ms since
    the epoch."""

    id: tuple[int, int]
    type: TaskType
    status: TaskStatus
    created_at_ms_epoch: int
    last_updated_at_ms_epoch: int
    assigned_client: tuple[int, int]
    assigned_segment: str
    message: str


class TaskMethods:
    """Mixed into MooncakeDistributedStore (``_c``, ``_call``)."""

    @pybind
    @guard(on_error=lambda err, *_: (NO_TASK, code_of(err)))
    def create_copy_task(self, key: str, targets: list[str]) -> tuple:
        """Copy ``key``'s object to each segment of ``targets`` (one that already holds it is skipped).
        Returns (task id, 0) at once, the copy runs in the background (``query_task``); or ((0, 0), code)."""
        return self._create("copy", key, "", list(targets))

    @pybind
    @guard(on_error=lambda err, *_: (NO_TASK, code_of(err)))
    def create_move_task(self, key: str, source: str, target: str) -> tuple:
        """Move ``key``'s replica on segment ``source`` to segment ``target``. As create_copy_task."""
        return self._create("move", key, source, [target])

    @pybind
    @guard(on_error=lambda err, *_: (None, code_of(err)))
    def query_task(self, task_id: tuple[int, int]) -> tuple:
        """(QueryTaskResponse, 0), or (None, code): -1400 for an id this master does not know (a failover
        forgets the tasks)."""
        if self._sharded():
            return None, UNAVAILABLE_IN_CURRENT_MODE
        [(code, row)] = self._call("task_query", [list(task_id)])
        if code != protocol.OK:
            return None, TASK_NOT_FOUND
        hi, lo, kind, status, created, updated, segment, message = row
        return QueryTaskResponse(
            (hi, lo), TaskType[kind], TaskStatus[status], created, updated, _client_id(segment), segment, message
        ), OK

    def _create(self, kind: str, key: str, source: str, targets: list[str]) -> tuple:
        if self._sharded():
            return NO_TASK, UNAVAILABLE_IN_CURRENT_MODE
        [(code, value)] = self._call("task_create", [[kind, key, source, targets]])
        if code != protocol.OK:
            log.warning("create_%s_task(%r) refused: %s", kind, key, value)
            return NO_TASK, CODES.get(code, INVALID_PARAMS)
        return tuple(value), OK

    def _sharded(self) -> bool:
        """A sharded store runs no replica tasks (its nodes have no command link yet; docs/operations.md)."""
        if self._c.master.startswith("shards://"):
            log.warning("replica tasks: %s is a sharded store; its nodes run no copy/move tasks", self._c.master)
            return True
        return False


def _client_id(segment: str) -> tuple[int, int]:
    import xxhash

    h = xxhash.xxh3_128_intdigest(segment.encode())
    return h >> 64, h & (2**64 - 1)
