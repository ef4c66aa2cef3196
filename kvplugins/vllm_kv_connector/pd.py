"""P/D disaggregation: a prefill instance (``kv_role: kv_producer``) hands a request's KV to a decode instance
(``kv_consumer``), through the store or directly.

* Producer: ``request_finished`` returns ``(True, {"kvplugins": params})`` and vLLM holds the request's blocks
  until the worker reports it in ``finished_sending``: for the store path once its page saves landed, for the
  direct path once the decode side acknowledged its read (it writes the request's token into this producer's
  mailbox word) or ``pd_hold_ms`` passed. While it holds them, the request's lease word (second half of the
  mailbox) holds its token; the decode side reads that word after its data read and treats the read as failed
  unless the token is still there, so blocks freed and reused before the read never become wrong tokens.
* Consumer: the params come back in the decode request (``SamplingParams.extra_args["kv_transfer_params"]`` or
  the OpenAI ``kv_transfer_params`` field). Store path: look the pages up (waiting up to ``pd_wait_ms`` for the
  producer's saves to land), then load as any hit. Direct path: read the producer's KV blocks straight into
  the allocated blocks (on one host with process_vm_readv, vmread.py, else through the transfer core's TCP),
  then ack.

params (JSON): ``v``, ``mode`` ("store"/"direct"), ``pages`` (full prompt pages computed), ``namespace`` (rank
0's key namespace: both sides must match); direct adds ``block_ids`` (producer blocks of those pages), ``slot``,
``token`` and ``ranks`` (TP rank -> ``PDHandshake`` fields). Source followed: vLLM 0.32 KVConnectorBase_V1
(request_finished / get_finished / handshake metadata) and the NIXL connector's P/D flow (read, not copied).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from kvplugins.errors import ConfigError, KVPluginsError
from kvplugins.layout import PageLayout
from kvplugins.vllm_kv_connector import vmread

log = logging.getLogger(__name__)

PARAMS_KEY = "kvplugins"
MAILBOX_SLOTS = 4096  # acks in flight per producer; a slot is reused after 4096 newer requests
# mailbox layout (uint64 words): [0, SLOTS) ack words (written by decode), [SLOTS, 2*SLOTS) lease words (producer)


@dataclass
class PDHandshake(KVConnectorHandshakeMetadata):
    """What a producer worker exports: its transfer-engine descriptor (SegmentDescriptor.to_wire()), its KV
    planes in page order as ``[region_id, offset, block_stride, block_bytes, address]`` (bytes; the address
    of block 0 in the producer, for same-host reads with vmread.py), its mailbox ``[region_id, slots]`` (one
    uint64 word per slot) and its process id."""
    descriptor: dict = field(default_factory=dict)
    planes: list = field(default_factory=list)
    mailbox: list = field(default_factory=list)
    pid: int = 0


def params_of(request) -> dict | None:
    """Our part of a request's kv_transfer_params, or None."""
    p = getattr(request, "kv_transfer_params", None) or {}
    ours = p.get(PARAMS_KEY) if isinstance(p, dict) else None
    return ours if isinstance(ours, dict) and ours.get("v") == 1 else None


def _engine(cfg):
    from kvplugins.transfer import TransferEngine
    from kvplugins.transfer.config import transfer_config
    return TransferEngine(transfer_config(host=cfg.pd_host, transports=cfg.transports,
                                          timeout_ms=float(cfg.transfer_timeout_ms)))


class Export:
    """Producer worker: its KV memory and a mailbox exported through a transfer engine of its own."""

    def __init__(self, layout: PageLayout, cfg):
        self.engine = _engine(cfg)
        for addr, nbytes in layout.regions():
            self.engine.register(addr, length=nbytes, export=True)
        self.mailbox = self.engine.alloc_shared(2 * MAILBOX_SLOTS * 8, export=True)
        self._words = np.frombuffer(self.engine.memoryview(self.mailbox), dtype=np.uint64)
        planes = []
        for p in layout.planes:
            r = self.engine.region_for(p.base, p.block_bytes)
            planes.append([r.region_id, p.base - r.addr, p.block_stride, p.block_bytes, p.base])
        self.handshake = PDHandshake(self.engine.descriptor().to_wire(), planes,
                                     [self.mailbox.region_id, MAILBOX_SLOTS], os.getpid())

    def acked(self, slot: int, token: int) -> bool:
        """Whether the decode side wrote ``token`` into mailbox word ``slot``."""
        return int(self._words[slot]) == token

    def lease(self, slot: int, token: int) -> None:
        """Mark the blocks of ``slot``'s request held (token) or released (0)."""
        self._words[MAILBOX_SLOTS + slot] = token

    def close(self) -> None:
        self.engine.close()


class Reader:
    """Consumer worker: reads producer blocks into its own blocks (registered with a transfer engine) and acks."""

    def __init__(self, layout: PageLayout, cfg):
        self.layout, self.engine, self._wait_s = layout, _engine(cfg), cfg.pd_wait_ms / 1000
        for addr, nbytes in layout.regions():
            self.engine.register(addr, length=nbytes)
        self._ack = np.zeros(2, dtype=np.uint64)  # [0]: ack word to write, [1]: lease word read back
        self._ack_region = self.engine.register(self._ack)
        self._vm_ok = True  # same-host reads with process_vm_readv, until one fails

    def read(self, src: dict, local_ids: list[int], remote_ids: list[int], slot: int, token: int) -> list[int]:
        """Copy producer block ``remote_ids[i]`` into local block ``local_ids[i]``; returns local ids that failed.
        src: the producer rank's PDHandshake fields. Every page fails, unread, if the producer's lease for
        (slot, token) does not show within pd_wait_ms, and after the read if it is no longer held (blocks
        released, maybe reused). Raises nothing: any error fails every page."""
        try:
            from kvplugins.transfer import SegmentDescriptor
            desc = SegmentDescriptor.from_wire(src["descriptor"])  # once: the lease poll reads it every 5 ms
            seen = self._wait_lease(src, desc, slot, token)
            if seen is not None:
                log.warning("kvplugins: the producer did not hold the blocks of token %d within pd_wait_ms=%d "
                            "(released after pd_hold_ms, or a restarted producer; %s): not reading them", token,
                            self._wait_s * 1000, seen)
                return list(local_ids)
            t0 = time.monotonic()
            failed = self._read(src, desc, local_ids, remote_ids)
            if failed:
                log.warning("kvplugins: direct read of %d pages: %d failed after %.0f ms", len(local_ids),
                            len(failed), (time.monotonic() - t0) * 1000)
            if not self._leased(src, desc, slot, token):
                log.warning("kvplugins: the producer no longer holds the blocks of token %d (released after "
                            "pd_hold_ms): its bytes are not used", token)
                return list(local_ids)
            return failed
        except (KVPluginsError, KeyError, TypeError, ValueError) as e:
            log.warning("kvplugins: direct read of %d pages failed: %r", len(local_ids), e)
            return list(local_ids)

    def _wait_lease(self, src: dict, desc, slot: int, token: int) -> str | None:
        """None once the producer holds (slot, token), waiting up to pd_wait_ms (it marks the lease one engine
        step after the request finished, which may be after decode got the params); else what the polls saw:
        their count, the last lease word (0: not held yet or released; another token: the slot was reused) or
        the last read error."""
        deadline, polls, last = time.monotonic() + self._wait_s, 0, "no poll"
        while True:
            word, err = self._lease_word(src, desc, slot)
            polls += 1
            if err is None and word == token:
                return None
            last = f"last read failed: {err}" if err is not None else f"lease word {word}"
            if time.monotonic() >= deadline:
                return f"{polls} polls, {last}"
            time.sleep(0.005)

    def _read(self, src: dict, desc, local_ids: list[int], remote_ids: list[int]) -> list[int]:
        planes = src["planes"]
        mine = self.layout.planes
        if len(planes) != len(mine) or any(p[3] != q.block_bytes for p, q in zip(planes, mine)):
            raise ConfigError(f"producer KV planes {[p[3] for p in planes]} B differ from this engine's "
                              f"{[q.block_bytes for q in mine]} B")
        if self._vm_read(src, desc, local_ids, remote_ids):
            return []
        by_region: dict[int, tuple[list, list, list, list]] = {}
        for i, (lb, rb) in enumerate(zip(local_ids, remote_ids)):
            for (region, off, stride, nbytes, *_), q in zip(planes, mine):
                a, o, n, page = by_region.setdefault(region, ([], [], [], []))
                a.append(q.base + lb * q.block_stride)
                o.append(off + rb * stride)
                n.append(nbytes)
                page.append(i)
        failed: set[int] = set()
        first = None
        for region, (a, o, n, page) in by_region.items():
            errors = self.engine.read_spans(desc, region, np.array(a, np.uint64), np.array(o, np.uint64),
                                            np.array(n, np.uint64))
            bad = [j for j, e in enumerate(errors) if e is not None]
            failed.update(page[j] for j in bad)
            first = first or (errors[bad[0]] if bad else None)
        if failed:
            log.warning("kvplugins: %d of %d pages failed to read from the producer: %r", len(failed),
                        len(local_ids), first)
        return [local_ids[i] for i in sorted(failed)]

    def _vm_read(self, src: dict, desc, local_ids: list[int], remote_ids: list[int]) -> bool:
        """Same host: copy the blocks with process_vm_readv (no producer thread involved); False (after logging
        the reason once) where that is not possible, and the transfer core reads them instead."""
        planes, mine = src["planes"], self.layout.planes
        if not self._vm_ok or desc.host_id != self.engine.host_id or not src.get("pid") \
                or any(len(p) < 5 for p in planes):
            return False
        spans = [(q.base + lb * q.block_stride, p[4] + rb * p[2], p[3])
                 for lb, rb in zip(local_ids, remote_ids) for p, q in zip(planes, mine)]
        why = vmread.read(src["pid"], spans)
        if why is not None:
            self._vm_ok = False
            log.warning("kvplugins: reading the producer's KV memory directly failed (%s); using the transfer "
                        "core (TCP) from now on", why)
        return why is None

    def _leased(self, src: dict, desc, slot: int, token: int) -> bool:
        word, err = self._lease_word(src, desc, slot)
        return err is None and word == token

    def _lease_word(self, src: dict, desc, slot: int) -> tuple[int, object]:
        """(lease word of ``slot`` in the producer's mailbox, read error or None)."""
        self._ack[1] = 0
        err = self.engine.read_spans(desc, src["mailbox"][0], np.array([self._ack.ctypes.data + 8], np.uint64),
                                     np.array([(MAILBOX_SLOTS + slot) * 8], np.uint64), np.array([8], np.uint64))[0]
        return int(self._ack[1]), err

    def ack(self, src: dict, slot: int, token: int) -> None:
        """Tell the producer its blocks are free (best effort: it frees them after pd_hold_ms anyway)."""
        from kvplugins.transfer import SegmentDescriptor
        try:
            self._ack[0] = token
            desc = SegmentDescriptor.from_wire(src["descriptor"])
            err = self.engine.write_spans(desc, src["mailbox"][0], np.array([self._ack.ctypes.data], np.uint64),
                                          np.array([slot * 8], np.uint64), np.array([8], np.uint64))[0]
            if err is not None:
                raise err
        except (KVPluginsError, KeyError, TypeError, ValueError) as e:
            log.warning("kvplugins: ack to the producer failed (it frees the blocks after pd_hold_ms): %r", e)

    def close(self) -> None:
        self.engine.close()


def handshake_dict(meta: Any) -> dict:
    """PDHandshake (or its dict) -> plain dict for the params."""
    return asdict(meta) if isinstance(meta, PDHandshake) else dict(meta)
