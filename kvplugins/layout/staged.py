"""Pages whose KV blocks live in device memory, staged through bounded host bounce slots (issue #14).

Save (``StagedPages.save``): on a dedicated copy stream, after the event the engine recorded when its forward
was enqueued, gather each page's blocks from every plane into one [pages, page_bytes] device buffer, copy it
to a pinned host slot (one device-to-host copy, non_blocking), record one event per chunk and wait for it on
the calling (save) thread, then ``batch_put_from`` the slot's pages. Load (``StagedPages.load``): the slot is
filled by ``batch_get_into``, then, on the copy stream after the engine's event, one host-to-device copy of
the chunk and a scatter of the pages that arrived into their blocks; the calling thread waits for that chunk's
event, so the blocks hold the bytes before the engine's next forward is enqueued. A page whose transfer failed
is never scattered. Pages move in chunks of one slot (transfer/staging.py); no host memory is allocated per page.

CPU KV can be staged too (``staging='always'``): the same gather/scatter code runs with torch CPU tensors (the
slot is then the gather buffer, and there are no streams: every step is synchronous), which is how CI, with
no GPU, runs every staged path. Source followed: vLLM 0.32 offloading connector's CPU<->GPU block copies
(vllm/v1/kv_offload/worker/cpu_gpu.py: a dedicated stream, one event per transfer) and Mooncake's
``register_buffer`` contract (the store moves bytes between registered host memory only).
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from kvplugins.errors import ConfigError, SlotsBusy, StoreError
from kvplugins.layout.spans import PageLayout, Plane
from kvplugins.transfer.staging import StagingPool

SLOTS = 4  # concurrent staged batches (an engine's load and save threads, and an inline load), each a chunk


class DeviceCopier:
    """Gathers and scatters whole pages between a layout's planes (torch tensors on ``layout.device``) and host
    memory, on a dedicated stream. Raises ConfigError for a device this build cannot stage from (naming it and
    the fix): CUDA without a CUDA build of torch, or a device type other than cuda/cpu."""

    def __init__(self, layout: PageLayout):
        import torch

        self._torch, self.page_bytes = torch, layout.page_bytes
        self.device = torch.device(layout.device)
        self._stream = None
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"KV tensors on {layout.device}, but this torch {torch.__version__} has no CUDA "
                    "device; install the CUDA build of torch the engine uses, or keep the KV cache "
                    "on the CPU"
                )
            self._stream = torch.cuda.Stream(device=self.device)
        elif self.device.type != "cpu":
            raise ConfigError(
                f"KV tensors on {layout.device}: pages are staged from CUDA or CPU memory only; run "
                "the engine on CUDA or CPU, or leave the kvplugins connector out for this device"
            )
        offsets = [sum(p.block_bytes for p in layout.planes[:i]) for i in range(len(layout.planes))]
        self._views = [(_block_view(torch, p), off, p.block_bytes) for p, off in zip(layout.planes, offsets)]

    def host_buffer(self, nbytes: int):
        """A uint8 host tensor of ``nbytes``: page-locked when the device is CUDA (device copies from pageable
        memory would be synchronous staging copies). Raises ConfigError if it cannot be pinned."""
        torch = self._torch
        pinned = self.device.type == "cuda"
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        if pinned and not buf.is_pinned():
            raise ConfigError(
                f"could not page-lock {nbytes} B of bounce memory; raise the memlock limit "
                "(ulimit -l) or lower bounce_bytes"
            )
        if not pinned:
            buf.zero_()  # commit the pages now, not during the first load (page-locked memory already is)
        return buf

    def mark(self) -> Any:
        """An event on the calling thread's current stream (call it on the engine thread: after the forward for
        a save, before the load for a load); copies passed it as ``after`` wait for it. None on the CPU."""
        if self._stream is None:
            return None
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream(self.device))
        return ev

    def gather(self, block_ids: Sequence[int], host, after: Any = None) -> None:
        """Pages ``block_ids`` -> ``host`` (uint8, at least len(block_ids) * page_bytes), page i at i * page_bytes.
        Returns once the bytes are in ``host``."""
        torch, n, pb = self._torch, len(block_ids), self.page_bytes
        rows = host[: n * pb].view(n, pb)
        with self._on_stream(after) as done:
            idx = torch.as_tensor(list(block_ids), dtype=torch.long).to(self.device, non_blocking=True)
            out = rows if self._stream is None else torch.empty((n, pb), dtype=torch.uint8, device=self.device)
            for view, off, bb in self._views:
                out[:, off : off + bb] = view.index_select(0, idx)
            if out is not rows:
                rows.copy_(out, non_blocking=True)
        done()

    def scatter(self, block_ids: Sequence[int], host, rows: Sequence[int], after: Any = None) -> None:
        """Row ``rows[j]`` of ``host`` (viewed as [*, page_bytes]) -> the blocks of page ``block_ids[j]``.
        Returns once the blocks hold the bytes."""
        torch, pb = self._torch, self.page_bytes
        count = max(rows) + 1
        with self._on_stream(after) as done:
            src = host[: count * pb].view(count, pb).to(self.device, non_blocking=True)
            if list(rows) != list(range(count)):
                src = src.index_select(0, torch.as_tensor(list(rows), dtype=torch.long).to(self.device))
            idx = torch.as_tensor(list(block_ids), dtype=torch.long).to(self.device, non_blocking=True)
            for view, off, bb in self._views:
                view.index_copy_(0, idx, src[:, off : off + bb])
        done()

    @contextlib.contextmanager
    def _on_stream(self, after: Any):
        """Run the block on the copy stream after ``after``; yields ``done``: wait for what the block enqueued."""
        if self._stream is None:
            yield lambda: None
            return
        torch = self._torch
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            ev = torch.cuda.Event()
            yield ev.synchronize
            ev.record(self._stream)


class StagedPages:
    """Load/save whole pages of a device-resident ``layout`` through ``bounce_bytes`` of host memory, cut into
    SLOTS slots of whole pages.

    Lifecycle: ``StagedPages(layout, bounce_bytes, slot_timeout_s)`` -> register ``regions()`` with the store
    client (PageStore does) -> per batch, on the engine thread ``mark()``, then on any thread ``load`` /
    ``save`` with that mark -> ``close()``. Raises ConfigError (at construction) when a slot cannot hold one
    page, or as DeviceCopier.
    """

    def __init__(self, layout: PageLayout, bounce_bytes: int, slot_timeout_s: float):
        self.copier = DeviceCopier(layout)
        pb = self.page_bytes = layout.page_bytes
        self.pages_per_slot = bounce_bytes // SLOTS // pb
        if self.pages_per_slot < 1:
            raise ConfigError(
                f"bounce_bytes={bounce_bytes} holds fewer than {SLOTS} pages of {pb} B (one per "
                f"slot); raise bounce_bytes to at least {SLOTS * pb}"
            )
        slot_bytes = self.pages_per_slot * pb
        self._host = self.copier.host_buffer(SLOTS * slot_bytes)
        self.pool = StagingPool(self._host, SLOTS * slot_bytes, slot_bytes)
        self._timeout_s = slot_timeout_s

    def regions(self) -> list[tuple[int, int]]:
        return self.pool.regions()

    def mark(self) -> Any:
        return self.copier.mark()

    def load(self, client, keys: Sequence[str], block_ids: Sequence[int], after: Any = None) -> list:
        """Page ``keys[i]`` into block ``block_ids[i]``; per page None or the StoreError (its block untouched)."""

        def move(slot, host, ks, ids):
            errs = client.batch_get_into(ks, self._spans(slot, len(ks)))
            rows = [j for j, e in enumerate(errs) if e is None]
            if rows:
                self.copier.scatter([ids[j] for j in rows], host, rows, after)
            return errs

        return self._chunked(keys, block_ids, move)

    def save(self, client, keys: Sequence[str], block_ids: Sequence[int], after: Any = None) -> list:
        """Store block ``block_ids[i]``'s page under ``keys[i]``; per page None or the StoreError."""

        def move(slot, host, ks, ids):
            self.copier.gather(ids, host, after)
            return client.batch_put_from(ks, self._spans(slot, len(ks)))

        return self._chunked(keys, block_ids, move)

    def _chunked(self, keys, block_ids, move) -> list:
        out: list[StoreError | None] = []
        step = self.pages_per_slot
        for i in range(0, len(keys), step):
            ks, ids = list(keys[i : i + step]), list(block_ids[i : i + step])
            try:
                with self.pool.slot(self._timeout_s) as slot:
                    start = slot.index * self.pool.slot_bytes
                    out += move(slot, self._host[start : start + self.pool.slot_bytes], ks, ids)
            except SlotsBusy as e:  # no slot came free: these pages are not moved (a miss)
                out += [e] * len(ks)
        return out

    def _spans(self, slot, n: int) -> list[list[tuple[int, int]]]:
        return [[(slot.addr + j * self.page_bytes, self.page_bytes)] for j in range(n)]

    def close(self) -> None:
        self.pool.close()
        self._host = None


def _block_view(torch, p: Plane):
    """Plane ``p`` as a uint8 [num_blocks, block_bytes] view of its source tensor's storage (no copy)."""
    src = p.source
    if src is None:
        raise ConfigError(f"plane at {p.base:#x} carries no tensor; build the layout with planes_of() to stage it")
    t = src if isinstance(src, torch.Tensor) else torch.from_numpy(src)
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    return flat.as_strided((p.num_blocks, p.block_bytes), (p.block_stride, 1), p.base - storage.data_ptr())
