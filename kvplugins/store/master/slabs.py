"""Client-reserved space ("slabs"): one master round trip per put.

A client ``reserve``s a slab (1/64 of the largest segment at most, 1 MiB at least: small pools offer none): one
free block of a segment, taken without evicting anything (a pool that is full or too fragmented for it answers
STORE_FULL and the client puts with put_start, which evicts), which it fills front to
back on its own — it writes an object's bytes at its next free offset, then sends ``put`` [key, size, slab id,
offset] with the object's xxh3_64. ``put`` cuts the object's range off the front of the slab's remainder
(``Allocator.split``; a skipped gap before it is freed at once) and records the object complete, as put_commit
does: the put is visible to every client when its reply is sent (read-after-put holds across clients), after
ONE waited round trip instead of put_start + put_commit.

Lifetime: a slab lives ``put_timeout_ms`` after its reservation or its last ``put`` (the client writes into it
only while more than its transfer and RPC timeouts are left, so no write lands after expiry). An expired slab,
or one released by the next ``reserve`` (opts.release), frees its remainder. A slab dies with its segment;
a draining segment's slabs are released (their puts answer EXPIRED too); a ``put`` into an unknown or expired
slab answers EXPIRED and the client redoes that key with put_start (as it does when its write into a slab fails).
A slab's range is journaled (HA): a new leader does not take puts into it (they answer EXPIRED and the client
redoes them with put_start) but keeps its free part from other puts for put_timeout_ms (ha/recovery.py).
Source followed: Mooncake's put_start/put_end (FAST'25 §4.2) keeps two round trips; the slab is ours (issue #13).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from kvplugins.store.master import placement
from kvplugins.store.master.disk_state import Frozen
from kvplugins.store.master.quotas import refuse
from kvplugins.store.master.segments import Segment
from kvplugins.store.wire.protocol import EXISTS, EXPIRED, INVALID, OK, PENDING, STORE_FULL

log = logging.getLogger(__name__)
SLAB_SHARE = 64  # a slab is at most 1/64 of the largest segment ...
MIN_SLAB = 1 << 20  # ... and at least 1 MiB: a pool with no segment of 64 MiB offers no slabs (put_start)


@dataclass
class Slab:
    id: int
    seg: Segment
    front: int  # start of the unused remainder: an allocation of its own while front < end
    end: int
    expires: float


class Slabs:
    """The live slabs of one MasterService."""

    def __init__(self, service):
        self.svc = service
        self._slabs: dict[int, Slab] = {}
        self._ids = itertools.count(1)

    def ops(self) -> dict:
        return {"reserve": self.op_reserve, "put": self.op_put}

    def op_reserve(self, entries, opts, now):
        """entries [bytes wanted]; opts.release: slab ids whose remainder the client gives back. Per entry
        [OK, [slab id, segment, region id, offset, length, ttl ms, align]] (length may be less than asked: at
        most 1/64 of the largest segment), [INVALID, reason] (no segment is big enough to offer slabs: under
        64 MiB) or [STORE_FULL, reason]."""
        for sid in opts.release:
            slab = self._slabs.pop(sid, None)
            if slab is not None:
                self._free_rest(slab)
        svc = self.svc
        k, why = svc.quotas.room(svc.caller, list(entries), slabs=True)
        if why is not None:
            return refuse(self._reserve(entries[:k], now), k, len(entries), why)
        return self._reserve(entries, now)

    def _reserve(self, entries, now: float) -> list:
        svc, out = self.svc, []
        svc.free_due_zombies(now)  # space whose lease ended since the last sweep
        order = svc.segments.by_free_space()
        biggest = max((s.size for s in order), default=0)
        align = svc.cfg.alloc_align
        for want in entries:
            size = min(want, biggest // SLAB_SHARE) // align * align
            if size < min(want, MIN_SLAB):
                out.append(
                    [
                        INVALID,
                        f"no slabs in a pool whose largest segment has {biggest} bytes (they need "
                        f"{SLAB_SHARE * MIN_SLAB}); use put_start",
                    ]
                )
                continue
            placed = placement.try_place(size, 1, order)  # never evicts: a slab is not worth live objects
            if placed is None:
                out.append(
                    [
                        STORE_FULL,
                        f"no free block of {size} bytes for a slab (the pool is full or "
                        "fragmented); use put_start, which evicts",
                    ]
                )
                continue
            [(seg, off)] = placed
            slab = Slab(next(self._ids), seg, off, off + size, now + svc.cfg.put_timeout_ms / 1000)
            self._slabs[slab.id] = slab
            svc.journal.slab_added(slab)
            out.append([OK, [slab.id, seg.name, seg.region_id, off, size, svc.cfg.put_timeout_ms, align]])
            svc.quotas.took(svc.caller, [(("slab", slab.id), size)], out[-1:])
        return out

    def op_put(self, entries, opts, now):
        """entries [key, size, slab id, offset]; opts.xxh3 one checksum per entry (or None). Per entry
        [OK, None], [EXISTS, "complete"] (nothing recorded), [PENDING, why] (another writer's put of the key
        has not committed: nothing recorded, the client retries), [EXPIRED, why] (slab unknown or expired: put again
        with put_start) or [INVALID, why] (the range is not at or after the slab's front, or overruns it)."""
        svc, sums = self.svc, opts.xxh3
        if sums is not None and len(sums) != len(entries):
            raise ValueError(f"put: opts: xxh3 has {len(sums)} checksums for {len(entries)} keys")
        expires, out = now + svc.cfg.put_timeout_ms / 1000, []
        done = self._put_run(entries, sums, now, expires)
        if done is not None:
            out = [[OK, None] for _ in done]
        else:
            done = self._put_each(entries, sums, now, expires, out)
        self._finish(len(done), done, now)
        return out

    def serve_put(self, put, sid: int, n: int, now: float) -> bytes | None:
        """The native front's put (service.py serve_native): ``put``, parsed by ObjectTable.serve, of ``n`` keys
        into slab ``sid``, applied as op_put applies its common batch (_put_run) with the same counters, journal,
        events and watermark evictions. Returns the reply body, or None with nothing changed (the slab is unknown,
        expired or leaving; an entry is not back to back from its front or overruns it; a key is stored or
        repeats): the Python path then answers the request key by key."""
        slab = self._open(sid, now)
        if slab is None:
            return None
        svc, seg = self.svc, slab.seg
        keep = svc.journal.keeps or svc.events.keeps
        got = svc.table.commit_put(put, seg.name, seg.allocator.align, slab.front, slab.end, now, keep)
        if got is None:
            return None
        reply, rounded, done = got
        self._advance(slab, rounded, now + svc.cfg.put_timeout_ms / 1000)
        self._finish(n, done, now, seg)
        return reply

    def _finish(self, n: int, done: list | None, now: float, touched: Segment | None = None) -> None:
        """A put made ``n`` objects complete (``done``: them, or None where neither the journal nor the events
        keep them): counted, journaled, published, then the watermark evictions they may call for (``touched``:
        the one segment they are on, when the put took one slab: service.evict_watermarks)."""
        svc = self.svc
        svc.counters["puts"] += n
        svc.counters["commits"] += n
        if done is not None:
            svc.journal.committed(done)
            svc.events.stored(done)
        svc.evict_watermarks(now, n, touched)

    def _put_each(self, entries, sums, now: float, expires: float, out: list) -> list:
        """op_put key by key: appends each entry's answer to ``out``; returns the new objects."""
        svc, done, live = self.svc, [], {}
        get, new = svc.table.get, svc.table.new_committed
        for j, (key, size, sid, off) in enumerate(entries):
            slab = live[sid] if sid in live else live.setdefault(sid, self._live(sid, now, expires))
            if slab is None:
                out.append(
                    [EXPIRED, f"slab {sid} is unknown, expired or on a leaving segment; put {key} with put_start"]
                )
                continue
            obj = get(key)
            if obj is not None:
                svc.counters["put_skipped"] += 1
                out.append(
                    [EXISTS, "complete"]
                    if obj.complete
                    else [PENDING, "another writer's put of this key has not committed yet; retry"]
                )
                continue
            seg = slab.seg
            align = seg.allocator.align
            end = off + ((size + align - 1) & -align)
            if off < slab.front or end > slab.end or off & (align - 1):
                out.append(
                    [
                        INVALID,
                        f"{key}: [{off}, {end}) is not an aligned range at or after slab {sid}'s "
                        f"front {slab.front} and inside it (end {slab.end})",
                    ]
                )
                continue
            self._carve(slab, off, end)
            done.append(new(key, size, [(seg.name, off)], now, None if sums is None else sums[j]))  # as put_commit
            out.append([OK, None])
        return done

    def _put_run(self, entries, sums, now: float, expires: float) -> list | None:
        """The common batch in one native pass: every entry in one live slab, back to back from its front and
        inside it, no key stored or repeated. Returns the new objects (every entry answered OK), or None with
        nothing changed: then op_put answers key by key, with the same outcome."""
        sid = entries[0][2] if entries else None
        if sid is None or any(e[2] != sid for e in entries):
            return None
        slab = self._open(sid, now)
        if slab is None:
            return None
        seg = slab.seg
        align, front = seg.allocator.align, slab.front
        sizes = [e[1] for e in entries]
        rounded = [(n + align - 1) & -align for n in sizes]
        offsets = [e[3] for e in entries]
        if offsets != list(itertools.accumulate(rounded[:-1], initial=front)) or offsets[-1] + rounded[-1] > slab.end:
            return None
        objs = self.svc.table.insert_new([e[0] for e in entries], sizes, seg.name, offsets, now, sums)
        if objs is not None:
            self._advance(slab, rounded, expires)
        return objs

    def _open(self, sid: int, now: float) -> Slab | None:
        """Slab ``sid`` if it can take puts (known, not expired, its segment registered and not leaving)."""
        slab = self._slabs.get(sid)
        return slab if slab is not None and slab.expires > now and self._usable(slab) else None

    def _live(self, sid: int, now: float, expires: float) -> Slab | None:
        """_open, the slab renewed until ``expires``."""
        slab = self._open(sid, now)
        if slab is not None:
            slab.expires = expires
        return slab

    def _advance(self, slab: Slab, rounded, expires: float) -> None:
        """Objects took ``rounded`` bytes each (a list or uint64 array), back to back from ``slab``'s front: each is
        cut into an allocation of its own, the front moves past them, the slab is renewed until ``expires``."""
        slab.expires = expires
        slab.front = slab.seg.allocator.split_run(slab.front, rounded)

    def _carve(self, slab: Slab, off: int, end: int) -> None:
        """Make [off, end) an allocation of its own, cut from the front of ``slab``'s remainder."""
        alloc = slab.seg.allocator
        if off > slab.front:  # a key the client skipped (its transfer failed): free the gap
            alloc.split(slab.front, off)
            alloc.free(slab.front)
        if end < slab.end:
            alloc.split(off, end)
        slab.front = end

    def _usable(self, slab: Slab) -> bool:
        """The slab's segment is still registered (the same one) and not draining (its allocator frozen)."""
        return self.svc.segments.get(slab.seg.name) is slab.seg and not isinstance(slab.seg.allocator, Frozen)

    def _free_rest(self, slab: Slab) -> None:
        if slab.front < slab.end and self.svc.segments.get(slab.seg.name) is slab.seg:
            slab.seg.allocator.free(slab.front)
        slab.front = slab.end
        self.svc.journal.slab_removed(slab.id)
        self.svc.quotas.done((("slab", slab.id),))

    def tick(self, now: float) -> None:
        """Free the remainder of expired slabs and of slabs on draining segments; forget those of segments gone."""
        for sid in [s.id for s in self._slabs.values() if s.expires <= now or not self._usable(s)]:
            self._free_rest(self._slabs.pop(sid))

    def held_bytes(self) -> int:
        return sum(s.end - s.front for s in self._slabs.values())

    def __len__(self) -> int:
        return len(self._slabs)
