"""The master's persistence seam: every change to committed placement goes through a Journal.

Allocations not backing a committed object (pending puts, slabs) are hooks too, so a new HA leader never hands
their bytes to another put while their writer may still land there (issue #30 item 10).
MasterService calls these hooks from its single thread, after the change is applied in memory and before the
op's reply is sent, so an acknowledged put is durable once ``committed`` returns. The base class keeps nothing
(the embedded / single-master default); the etcd-backed journal (master HA, issue #6) persists and recovers.
Hooks must not raise for a transient store outage they can retry; a hook that cannot persist raises
kvplugins.errors.StoreError and the op answers an error instead of acknowledging.
"""

from __future__ import annotations


class Journal:
    """No persistence. Subclasses override every hook. ``wanted(obj)``: the replica count ``obj`` is short to
    while re-replication owes it copies (MasterService sets it to Repairs.wanted), else 0: a journal that keeps
    it lets a new HA leader take the copies over. ``keeps``: whether the hooks do anything (False here: a
    batch op may skip building the objects it would pass them)."""

    keeps = False

    def __init__(self) -> None:
        self.wanted = _none_wanted

    def committed(self, objs: list) -> None:
        """``objs`` (metadata.Object) became complete (put_commit, promotion, migration)."""

    def removed(self, objs: list) -> None:
        """``objs`` left the table (remove, eviction without offload, lost every replica)."""

    def replicas_changed(self, objs: list) -> None:
        """``objs`` still exist but their replica list or tier changed (offload, drain, a copy added)."""

    def replicas_lost(self, objs: list, segment: str) -> None:
        """Complete ``objs`` lost their replica on ``segment``, which was removed (its ``segment_removed`` or
        ``segment_parked`` comes in the same op): their records may be rewritten later, over several turns, since a
        record naming a removed segment reads right (a new HA leader ignores replicas on segments it does not
        know), but they are rewritten before ``segment`` is added again."""

    def records_gone(self, keys: list[str], segments) -> None:
        """The objects ``keys`` lost their last replica with removed ``segments`` (names) and left the table, or a
        new HA leader's recovery dropped them (their records name only segments it does not know): their records may
        be deleted later, like ``replicas_lost``'s rewrites (a record naming only unknown segments reads as gone on a
        new leader), but before any of ``segments`` is added again."""

    def pending(self, objs) -> None:
        """``objs`` were allocated for a put not committed yet (put_start), or their replicas changed meanwhile:
        a new HA leader learns them, so their writers' commits succeed and no other put gets their bytes.
        ``objs``: any iterable, walked at most once."""

    def slab_added(self, slab) -> None:
        """Slab ``slab`` (slabs.Slab) was reserved by a client: a new HA leader keeps its space from other puts
        until a writer could still land in it."""

    def slab_removed(self, slab_id: int) -> None:
        """Slab ``slab_id`` was released or expired."""

    def task_changed(self, task) -> None:
        """Replica task ``task`` (replica_tasks.Task) was created, started a write (its destination allocated) or
        finished: a new HA leader answers ``task_query`` for it and holds that destination's space."""

    def task_forgotten(self, task_id: tuple[int, int]) -> None:
        """Finished task ``task_id`` left the master's memory (replica_tasks.FINISHED_KEPT)."""

    def flight_started(self, fid: int, segment: str, start: int, end: int) -> None:
        """A disk-tier flight ``fid`` (promote, migrate) allocated [start, end) of ``segment`` for a node to write
        into: a new HA leader holds that space until the node's write could still land."""

    def flight_ended(self, fid: int) -> None:
        """Flight ``fid`` ended (committed, failed, timed out, cancelled)."""

    def segment_added(self, seg) -> None:
        """Segment ``seg`` (segments.Segment) registered."""

    def segment_removed(self, name: str) -> None:
        """Segment ``name`` left (unregister, heartbeat timeout, drained)."""

    def segment_parked(self, seg) -> None:
        """Segment ``seg`` was removed for silence and left a manifest (liveness.py): the objects it held last keep
        their records (not ``removed``), so a new HA leader keeps the manifest and the returning process gets them
        back from it too."""

    def manifest_dropped(self, name: str, keys: list[str], forget_owner: bool) -> None:
        """The manifest of parked segment ``name`` was used or dropped: ``keys`` (its objects neither restored nor
        stored again) are gone, and so is the parked record (with ``forget_owner``, the segment's owner record
        too: the name is not live)."""


def _none_wanted(obj) -> int:
    return 0
