"""P/D handover: a decode worker reads a request's KV blocks straight out of a prefill worker's KV memory, safe
against blocks freed and reused under the read. Engine-independent; the vLLM connector drives it
(vllm_kv_connector/pd.py puts an Offer in its handshake and the request's params), and SGLang can too.

Lifecycle, in call order:
  1. Producer(layout, transfer)      exports the KV memory and a mailbox (2 * MAILBOX_SLOTS uint64 words)
                                     through a transfer engine of its own; ``offer`` is what decode needs.
  2. producer.lease(slot, token)     while it holds a request's blocks; lease(slot, 0) once it frees them.
  3. Consumer(layout, transfer, wait_ms).read(offer, local_ids, remote_ids, slot, token)
                                     waits up to wait_ms for the lease, reads the blocks, then reads the lease
                                     word again: bytes are used only if the token was still there afterwards,
                                     so a read that raced a release never becomes wrong tokens.
  4. consumer.ack(offer, slot, token)  writes the token into the producer's ack word;
     producer.acked(slot, token)     tells the producer it may free the blocks (it frees them after a hold
                                     time anyway).
The transfer core picks the path per read: same host, cma (process_vm_readv: no producer thread runs), else
rdma or tcp. Mailbox layout (uint64 words): [0, SLOTS) ack words (written by decode), [SLOTS, 2*SLOTS) lease
words (written by the producer). Source followed: vLLM's NIXL connector P/D flow (read, not copied).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvplugins.errors import ConfigError, KVPluginsError, ProtocolError
from kvplugins.layout.spans import PageLayout
from kvplugins.transfer import SegmentDescriptor, TransferConfig, TransferEngine

log = logging.getLogger(__name__)

MAILBOX_SLOTS = 4096  # acks in flight per producer; a slot is reused after 4096 newer requests
MAX_PLANES = 1 << 16  # planes one offer may list (layers x K/V planes)


@dataclass(frozen=True)
class RemotePlane:
    """One producer KV plane as decode reads it: block ``b`` is ``block_bytes`` at ``offset + b * block_stride``
    of exported region ``region_id`` (bytes)."""

    region_id: int
    offset: int
    block_stride: int
    block_bytes: int


@dataclass(frozen=True)
class Offer:
    """What a producer worker exports: its transfer engine's descriptor, its KV planes in page order, and its
    mailbox region. ``to_wire()`` gives a JSON- and msgpack-able dict; ``from_wire`` checks one a peer sent."""

    descriptor: SegmentDescriptor
    planes: tuple[RemotePlane, ...]
    mailbox_region: int
    slots: int = MAILBOX_SLOTS

    def to_wire(self) -> dict[str, object]:
        return {
            "descriptor": self.descriptor.to_wire(),
            "planes": [[p.region_id, p.offset, p.block_stride, p.block_bytes] for p in self.planes],
            "mailbox": [self.mailbox_region, self.slots],
        }

    @classmethod
    def from_wire(cls, d: object) -> "Offer":
        """The Offer of a to_wire() dict. Raises ProtocolError naming what is malformed."""
        try:
            if not isinstance(d, Mapping):
                raise TypeError(f"an offer is a map, not {type(d).__name__}")
            rows, (region, slots) = d["planes"], d["mailbox"]
            if not isinstance(rows, list) or len(rows) > MAX_PLANES:
                raise ValueError(f"planes must be a list of at most {MAX_PLANES}")
            planes = tuple(RemotePlane(*(_u64(v) for v in row)) for row in rows)
            if not all(len(row) == 4 for row in rows) or _u64(slots) != MAILBOX_SLOTS:
                raise ValueError(f"plane rows have 4 items and the mailbox {MAILBOX_SLOTS} slots")
            return cls(SegmentDescriptor.from_wire(d["descriptor"]), planes, _u64(region), MAILBOX_SLOTS)
        except (KeyError, TypeError, ValueError, ProtocolError) as e:
            raise ProtocolError(f"malformed P/D offer: {e!r:.200}") from e


def _u64(v: object) -> int:
    if type(v) is not int or not 0 <= v < 1 << 64:
        raise ValueError(f"expected an integer in [0, 2**64), got {v!r:.40}")
    return v


class Producer:
    """Prefill worker: its KV memory and a mailbox exported through a transfer engine of its own."""

    def __init__(self, layout: PageLayout, transfer: TransferConfig):
        self.engine = TransferEngine(transfer)
        for addr, nbytes in layout.regions():
            self.engine.register(addr, length=nbytes, export=True)
        self.mailbox = self.engine.alloc_shared(2 * MAILBOX_SLOTS * 8, export=True)
        self._words = np.frombuffer(self.engine.memoryview(self.mailbox), dtype=np.uint64)
        planes = []
        for p in layout.planes:
            r = self.engine.region_for(p.base, p.block_bytes)
            planes.append(RemotePlane(r.region_id, p.base - r.addr, p.block_stride, p.block_bytes))
        self.offer = Offer(self.engine.descriptor(), tuple(planes), self.mailbox.region_id)

    def acked(self, slot: int, token: int) -> bool:
        """Whether the decode side wrote ``token`` into mailbox word ``slot``."""
        return int(self._words[slot]) == token

    def lease(self, slot: int, token: int) -> None:
        """Mark the blocks of ``slot``'s request held (token) or released (0)."""
        self._words[MAILBOX_SLOTS + slot] = token

    def close(self) -> None:
        self.engine.close()


class Consumer:
    """Decode worker: reads producer blocks into its own blocks (registered with a transfer engine) and acks."""

    def __init__(self, layout: PageLayout, transfer: TransferConfig, wait_ms: float):
        self.layout, self.engine, self._wait_s = layout, TransferEngine(transfer), wait_ms / 1000
        for addr, nbytes in layout.regions():
            self.engine.register(addr, length=nbytes)
        self._ack = np.zeros(2, dtype=np.uint64)  # [0]: ack word to write, [1]: lease word read back
        self._ack_region = self.engine.register(self._ack)

    def read(self, offer: Offer, local_ids: list[int], remote_ids: list[int], slot: int, token: int) -> list[int]:
        """Copy producer block ``remote_ids[i]`` into local block ``local_ids[i]``; returns local ids that failed.
        Every page fails, unread, if the producer's lease for (slot, token) does not show within wait_ms, and
        after the read if it is no longer held (blocks released, maybe reused). Raises nothing: any error fails
        every page."""
        try:
            seen = self._wait_lease(offer, slot, token)
            if seen is not None:
                log.warning(
                    "kvplugins: the producer did not hold the blocks of token %d within %.0f ms "
                    "(released after its hold time, or a restarted producer; %s): not reading them",
                    token,
                    self._wait_s * 1000,
                    seen,
                )
                return list(local_ids)
            t0 = time.monotonic()
            failed = self._read(offer, local_ids, remote_ids)
            if failed:
                log.warning(
                    "kvplugins: direct read of %d pages: %d failed after %.0f ms",
                    len(local_ids),
                    len(failed),
                    (time.monotonic() - t0) * 1000,
                )
            if self._lease_word(offer, slot) != (token, None):
                log.warning(
                    "kvplugins: the producer no longer holds the blocks of token %d (released after its "
                    "hold time): its bytes are not used",
                    token,
                )
                return list(local_ids)
            return failed
        except (KVPluginsError, KeyError, TypeError, ValueError) as e:
            log.warning("kvplugins: direct read of %d pages failed: %r", len(local_ids), e)
            return list(local_ids)

    def _wait_lease(self, offer: Offer, slot: int, token: int) -> str | None:
        """None once the producer holds (slot, token), waiting up to wait_ms (it marks the lease one engine step
        after the request finished, which may be after decode got the params); else what the polls saw: their
        count, the last lease word (0: not held yet or released; another token: the slot was reused) or the
        last read error."""
        deadline, polls = time.monotonic() + self._wait_s, 0
        while True:
            word, err = self._lease_word(offer, slot)
            polls += 1
            if err is None and word == token:
                return None
            if time.monotonic() >= deadline:
                return f"{polls} polls, " + (f"last read failed: {err}" if err is not None else f"lease word {word}")
            time.sleep(0.005)

    def _read(self, offer: Offer, local_ids: list[int], remote_ids: list[int]) -> list[int]:
        mine = self.layout.planes
        if len(offer.planes) != len(mine) or any(p.block_bytes != q.block_bytes for p, q in zip(offer.planes, mine)):
            raise ConfigError(
                f"producer KV planes {[p.block_bytes for p in offer.planes]} B differ from this "
                f"engine's {[q.block_bytes for q in mine]} B"
            )
        by_region: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}
        for i, (lb, rb) in enumerate(zip(local_ids, remote_ids)):
            for p, q in zip(offer.planes, mine):
                a, o, n, page = by_region.setdefault(p.region_id, ([], [], [], []))
                a.append(q.base + lb * q.block_stride)
                o.append(p.offset + rb * p.block_stride)
                n.append(p.block_bytes)
                page.append(i)
        failed: set[int] = set()
        first = None
        for region, (a, o, n, page) in by_region.items():
            errors = self.engine.read_spans(
                offer.descriptor, region, np.array(a, np.uint64), np.array(o, np.uint64), np.array(n, np.uint64)
            )
            bad = [j for j, e in enumerate(errors) if e is not None]
            failed.update(page[j] for j in bad)
            first = first or (errors[bad[0]] if bad else None)
        if failed:
            log.warning(
                "kvplugins: %d of %d pages failed to read from the producer: %r", len(failed), len(local_ids), first
            )
        return [local_ids[i] for i in sorted(failed)]

    def _lease_word(self, offer: Offer, slot: int) -> tuple[int, object]:
        """(lease word of ``slot`` in the producer's mailbox, read error or None)."""
        self._ack[1] = 0
        err = self.engine.read_spans(
            offer.descriptor, offer.mailbox_region, [self._ack.ctypes.data + 8], [(MAILBOX_SLOTS + slot) * 8], [8]
        )[0]
        return int(self._ack[1]), err

    def ack(self, offer: Offer, slot: int, token: int) -> None:
        """Tell the producer its blocks are free (best effort: it frees them after its hold time anyway)."""
        self._ack[0] = token
        err: Exception | None
        try:
            err = self.engine.write_spans(
                offer.descriptor, offer.mailbox_region, [self._ack.ctypes.data], [slot * 8], [8]
            )[0]
        except (KVPluginsError, ValueError) as e:  # a closed engine, a negative slot
            err = e
        if err is not None:
            log.warning("kvplugins: ack to the producer failed (it frees the blocks after its hold time): %r", err)

    def close(self) -> None:
        self.engine.close()
