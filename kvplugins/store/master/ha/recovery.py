"""Rebuild a fresh MasterService from the journal (EtcdJournal.load) when a master becomes leader.

Segments are re-added from their stored descriptors (same names) with a heartbeat of ``now``: a node that is
still alive keeps heart-beating the new leader (its bytes never moved), one that died times out after
heartbeat_timeout_ms like any silent segment and its objects are lost then. Every recovered object is complete,
unleased, and re-marks its bytes allocated in its segment's allocator; objects naming an unknown segment, an
offset that does not fit, or bytes another object holds are dropped (logged by key, counted in ``dropped``),
and a dropped replica leaves no space allocated. The values were type- and range-checked by journal.py already;
a segment whose descriptor does not hold together, or is not its etcd key's segment, is skipped (logged).
Pending puts of the old leader (journal.pending) come back pending, with put_timeout_ms from now: their writers'
put_commit succeeds on the new leader, and no other put gets their bytes meanwhile. The free part of each
journaled slab (client-reserved space) is held for put_timeout_ms, then freed; its record is deleted (slab puts
on the new leader answer EXPIRED and the client redoes them with put_start). So no write the old leader
allowed lands on bytes the new one gave to another put (issue #30 item 10). Replica tasks (restore_tasks)
come back for task_query; one the old leader was running ends (replica_tasks.failed_over) and the destination
of its write in flight is held for put_timeout_ms. So is the destination of every disk-tier flight (promote,
drain migration: hold_flights) the old leader had started, or ended while a late write could still land; the
node's report of it finds no flight on the new leader and the object stays where the journal has it.
A complete object left with fewer replicas than its record names, or than re-replication owed it (the record's
``wanted``), is queued for copies again (repair.py), so a failover does not forget what a lost node took.
A complete object on disk only (no replica in its record) comes back with none, awaiting the nodes' tier
registrations that name its copies (tiering.await_copies): were it left out, a put in that window would start
the key anew and the registration would find it pending and delete the disk copies as stale.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

from kvplugins.errors import KVPluginsError
from kvplugins.store.master.allocator import reserve
from kvplugins.store.master.replica_tasks import Task

log = logging.getLogger(__name__)


def restore(
    service,
    segs: list,
    objs: list,
    now: float,
    slabs: list = (),
    owners: dict | None = None,
    parked: dict | None = None,
) -> dict:
    """Load ``segs`` [(name, wire, region id, size)], ``objs`` [(key, size, replicas, checksum, pin, pending)]
    (oldest first) and ``slabs`` [(slab id, segment, start, end)] into ``service`` (an empty MasterService).
    ``owners``: segment name -> (owner digest, named credential) (EtcdJournal.load_owners): a recovered segment
    keeps its owner, so only its own process may re-register it, and, removed for silence, it leaves the
    manifest its returning process gets its objects back from (liveness.py). ``parked``: segment name -> size
    of the segments removed for silence whose manifests were journaled (EtcdJournal.load_parked): the complete
    objects whose replicas name such a segment, and no live one, make its manifest again.
    Returns {"segments", "objects" (pending ones included), "pending", "dropped", "slab_bytes" (held),
    "manifest_objects", "short" (complete objects queued for re-replication: repair.py), "disk_only" (complete
    objects with no DRAM replica, restored awaiting their nodes' tiers: tiering.await_copies)}."""
    service.tiering.took_over(now)  # the nodes' disk tiers register again on their next poll
    for name, wire, region_id, size in segs:
        _add_segment(service, name, wire, region_id, size, now, (owners or {}).get(name, (b"", "")))
    placed: dict[str, list] = {}  # segment name -> [(offset, size, key)]
    kept, dropped, manifests, parked, disk_only = [], [], {}, parked or {}, []
    stale: dict[str, list[str]] = {}  # key -> removed segments its record still names
    for key, size, replicas, *extra in objs:
        checksum, pin, pending = (*extra, *(None, 0, 0)[len(extra) :])[:3]
        if not replicas and not pending:  # complete, on disk only: its nodes' tiers name it again
            disk_only.append((key, size, checksum, pin))
            continue
        listed = list(dict.fromkeys(map(tuple, replicas)))
        good = [(n, off) for n, off in listed if service.segments.get(n) is not None]
        if not good:
            home = next((r for r in replicas if r[0] in parked), None)
            if home is not None and not pending:  # complete, its segment parked: its manifest again
                manifests.setdefault(home[0], []).append((key, size, home[1], checksum, pin, 0.0))
            else:  # a new leader deletes its record later (Journal.records_gone), as the old one would have
                dropped.append(key)
                service.journal.records_gone([key], {n for n, _ in listed})
            continue
        kept.append((key, size, good, len(listed), *extra))
        if len(good) < len(listed):  # the record names removed segments: rewritten soon (Journal.replicas_lost)
            stale[key] = [n for n, _ in listed if service.segments.get(n) is None]
        for n, off in good:
            placed.setdefault(n, []).append((off, size, key))
    bad = set()
    for name, blocks in placed.items():
        bad |= {(name, off, key) for off, key in reserve(service.segments.get(name).allocator, blocks)}
    for key, size, replicas, listed, *extra in kept:
        replicas = [(n, off) for n, off in replicas if (n, off, key) not in bad]
        if not replicas:  # its place overlaps another's: its record goes now, in recovery's own batch
            dropped.append(key)
            service.journal.removed([SimpleNamespace(key=key)])
            continue
        _add(service, key, size, replicas, now, *extra, listed=listed)
        for name in stale.get(key, ()):
            service.journal.replicas_lost([service.table.get(key)], name)
    tier = service.tiering
    tier.await_copies([tier.disk_only_object(k, n, checksum, now, pin) for k, n, checksum, pin in disk_only])
    held = _hold_slabs(service, slabs, now)
    parked_objects = _park(service, parked, manifests, owners or {}, now)
    if dropped:
        log.warning(
            "recovery dropped %d objects (segment unknown, offset outside it or overlapping another object), e.g. %s",
            len(dropped),
            ", ".join(repr(k[:100]) for k in dropped[:10]),
        )
    return {
        "segments": len(service.segments),
        "objects": len(service.table),
        "dropped": len(dropped),
        "pending": service.table.pending_count(),
        "slab_bytes": held,
        "manifest_objects": parked_objects,
        "short": len(service.repairs),
        "disk_only": len(disk_only),
    }


def _park(service, parked: dict, manifests: dict, owners: dict, now: float) -> int:
    """Rebuild the manifest of each parked segment (name -> size) from its objects ``manifests`` (name ->
    entries); a parked record with no object or no owner left is dropped. Returns the objects kept."""
    kept = 0
    for name, size in parked.items():
        owner = owners.get(name, (b"", ""))[0]
        entries = manifests.get(name, [])
        if service.segments.get(name) is not None or not owner or not entries:
            service.journal.manifest_dropped(name, [e[0] for e in entries], service.segments.get(name) is None)
            continue
        service.manifests.keep(SimpleNamespace(name=name, owner=owner, size=size), entries, now)
        kept += len(entries)
    return kept


def _hold_slabs(service, slabs: list, now: float) -> int:
    """Hold the free bytes of each journaled slab until put_timeout_ms from ``now``, and delete its record.
    Returns the bytes held."""
    until, held = now + service.cfg.put_timeout_ms / 1000, 0
    for slab_id, name, start, end in slabs:
        held += service.quarantine(name, start, end, until)
        service.journal.slab_removed(int(slab_id))
    return held


def hold_flights(service, flights: list, now: float) -> int:
    """Hold the free bytes of each journaled disk-tier flight's destination [(flight id, segment, start, end)]
    (EtcdJournal.load_flights) until put_timeout_ms from ``now``, and delete its record. Returns the bytes
    held."""
    until, held = now + service.cfg.put_timeout_ms / 1000, 0
    for fid, name, start, end in flights:
        held += service.quarantine(name, start, end, until)
        service.journal.flight_ended(fid)
    return held


def restore_tasks(service, tasks: list, now: float) -> int:
    """Load journaled replica tasks [((hi, lo), kind, key, source, targets, status, created ms, updated ms,
    message, dest)] (EtcdJournal.load_tasks, oldest update first) into ``service``; returns how many."""
    tasks_of, until = service.tiering.tasks, now + service.cfg.put_timeout_ms / 1000
    for tid, kind, key, source, targets, status, created, updated, message, dest in tasks:
        task = Task(tid, kind, key, None, source, list(targets), status, created, updated, message)
        if status in ("SUCCESS", "FAILED"):
            tasks_of.remember(task)
            continue
        if dest is not None:
            name, off, size = dest
            service.quarantine(name, off, off + size, until)
        tasks_of.failed_over(task)
    return len(tasks)


def _add_segment(service, name: str, wire: dict, region_id: int, size: int, now: float, owner: tuple) -> None:
    """Re-add journal segment ``name``, or skip it with a warning naming it: a descriptor that decodes but does
    not hold together (no such region, size beyond it), or one that is not this key's segment (the journal
    stores each segment under its own name; another one would replace that segment)."""
    own = f"{wire.get('segment_id')}:{region_id}"
    if own != name:
        log.warning("journal segment %r skipped: its descriptor is segment %r", name[:200], own[:200])
        return
    try:
        service.segments.add(wire, region_id, size, now, owner=owner[0], identity=owner[1])
        service.table.set_region(name, region_id)
    except (KVPluginsError, ValueError) as e:  # a descriptor that decodes but does not hold together
        log.warning("journal segment %r skipped: %s", name[:200], e)


def _add(
    service,
    key: str,
    size: int,
    replicas: list,
    now: float,
    checksum=None,
    pin: int = 0,
    pending: int = 0,
    wanted: int = 0,
    listed: int = 0,
) -> None:
    """Add a recovered object with its checksum and pin (the pin picks its LRU list): complete, or a pending put
    whose writer has put_timeout_ms from ``now`` to commit. A complete one with fewer ``replicas`` than its
    record ``listed`` (segments unknown, bytes taken) or ``wanted`` (re-replication owed) is queued for copies."""
    if pending:
        service.table.new(
            key, size, replicas, deadline=now + service.cfg.put_timeout_ms / 1000, last_access=now, pin=pin
        )
        return
    obj = service.table.new(key, size, replicas, complete=True, last_access=now, checksum=checksum, pin=pin)
    had = max(wanted, listed)
    if had > len(replicas):
        service.repairs.lost(obj, had)
