"""``KTMoEWrapper``: kt-kernel 0.7.2's inference wrapper API on kvplugins' native kernels.

Constructor: kt-kernel 0.7.2's arguments (``gpu_experts_mask``) and upstream SGLang 0.5.23's call
(``num_gpu_experts=N``: experts 0..N-1 run on the GPU). Per call from a CPU caller: ``submit_forward`` copies
the inputs (SGLang edits ``topk_ids`` in place right after submitting) and queues the layer on the shared CPU
engine; ``sync_forward`` waits and returns [T, H] in ``hidden_states``' dtype. A CUDA caller takes the
stream-ordered path instead (stream.py: pinned per-batch-size buffers and host functions on its stream, nothing
blocking the host, safe under CUDA graph capture); ``KTConfig.staging='always'`` sends CPU callers there too.
Source followed: kt_kernel/experts_base.py (BaseMoEWrapper) of kt-kernel 0.7.2.
"""

from __future__ import annotations

import logging
from typing import List, Optional

from kvplugins.config import load
from kvplugins.errors import ConfigError
from kvplugins.kt_expert_backend import deferral, methods, native, weights
from kvplugins.kt_expert_backend.config import KTConfig
from kvplugins.kt_expert_backend.engine import Engines, Pending
from kvplugins.kt_expert_backend.stream import StreamPath, numpy_view as _np

log = logging.getLogger("kvplugins.kt")
_UNSUPPORTED_NONZERO = ("swiglu_limit", "swiglu_alpha")


class _CaptureSizes:
    sizes: list = []


class KTMoEWrapper:
    """Routed experts of one MoE layer on the CPU (see module docstring). Raises ConfigError on bad arguments."""

    def __init__(
        self,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        gpu_experts_mask=None,
        cpuinfer_threads: int = 1,
        threadpool_count: int = 1,
        weight_path: Optional[str] = None,
        chunked_prefill_size: int = 8192,
        cpu_save: bool = False,
        max_deferred_experts_per_token: Optional[int] = None,
        method: str = "AMXINT4",
        numa_nodes: Optional[List[int]] = None,
        mode: str = "inference",
        num_gpu_experts: Optional[int] = None,
        **kt_extra,
    ):
        import torch

        if mode != "inference":
            raise ConfigError(f"mode={mode!r}: the kvplugins kt backend serves inference only")
        for k in _UNSUPPORTED_NONZERO:
            if kt_extra.get(k):
                raise ConfigError(f"{k}={kt_extra[k]} is not supported by the kvplugins kt backend (use 0)")
        self.cfg = load(KTConfig)
        self.method = methods.resolve(method)
        self.layer_idx, self.num_experts = int(layer_idx), int(num_experts)
        self.num_experts_per_tok, self.hidden_size = int(num_experts_per_tok), int(hidden_size)
        self.moe_intermediate_size = int(moe_intermediate_size)
        self.weight_path, self.chunked_prefill_size, self.cpu_save = weight_path, int(chunked_prefill_size), cpu_save
        self.max_deferred_experts_per_token = int(max_deferred_experts_per_token or 0)
        if not 0 <= self.max_deferred_experts_per_token < self.num_experts_per_tok:
            raise ConfigError(
                f"max_deferred_experts_per_token={max_deferred_experts_per_token} must be in "
                f"[0, num_experts_per_tok={num_experts_per_tok})"
            )
        self.gpu_experts_mask = _gpu_mask(torch, self.num_experts, gpu_experts_mask, num_gpu_experts)
        self.num_gpu_experts = int(self.gpu_experts_mask.sum())
        # uint8 [experts]: 1 where the GPU computes the expert, so the CPU kernels skip it
        self.skip_mask = self.gpu_experts_mask.to(torch.uint8).numpy()
        self.engine = Engines.get(
            cpuinfer_threads, threadpool_count, numa_nodes, self.cfg.spin_us, self.cfg.numa_sysfs, self.cfg.sync_spin_us
        )
        group = self.cfg.int4_group
        if self.method.format == "int4" and (self.hidden_size % group or self.moe_intermediate_size % group):
            group = 64  # the shape does not divide by the configured group; load_weights takes the file's
        self.layer = native.Layer(
            self.method.format,
            self.num_experts,
            self.hidden_size,
            self.moe_intermediate_size,
            group=group,
            isa=self.cfg.isa,
        )
        self._inflight = None
        self._stream = StreamPath(self, lambda: set(_CaptureSizes.sizes))

    # ---- weights ----
    def load_weights_from_tensors(self, gate_proj, up_proj, down_proj, physical_to_logical_map_cpu=None):
        """Quantize online from bf16/fp16/fp32 tensors: gate/up [E, I, H], down [E, H, I], indexed by logical
        expert; physical slot p gets logical expert map[p]. GPU-assigned slots are not loaded."""
        import torch

        for p in self._cpu_slots():
            e = self._logical(physical_to_logical_map_cpu, p)
            for name, w in (("gate", gate_proj), ("up", up_proj), ("down", down_proj)):
                m = w[e]
                if m.dtype not in (torch.bfloat16, torch.float32):
                    m = m.to(torch.bfloat16)
                self.layer.set_float(self.engine.pool, p, name, m.detach().cpu().contiguous())

    def load_weights(self, physical_to_logical_map_cpu=None):
        """Load this layer from ``weight_path`` (the `kvplugins kt convert` format, see weights.py)."""
        if not self.weight_path:
            raise ConfigError("load_weights needs weight_path (--kt-weight-path); or use load_weights_from_tensors")
        meta = weights.read_meta(self.weight_path)
        want = (self.method.format, self.num_experts, self.hidden_size, self.moe_intermediate_size)
        have = (meta.format, meta.num_experts, meta.hidden_size, meta.moe_intermediate_size)
        if want != have:
            raise ConfigError(
                f"{self.weight_path} holds (format, experts, H, I) = {have}, but --kt-method "
                f"{self.method.name} and the model need {want}; re-run `kvplugins kt convert`"
            )
        if meta.format == "int4" and meta.group != self.layer.group:
            self.layer = native.Layer(
                "int4",
                self.num_experts,
                self.hidden_size,
                self.moe_intermediate_size,
                group=meta.group,
                isa=self.cfg.isa,
            )
        reader = weights.LayerReader(self.weight_path, self.layer_idx)
        for p in self._cpu_slots():
            e = self._logical(physical_to_logical_map_cpu, p)
            for name in weights.PROJS:
                q, scale = reader.get(e, name)
                self.layer.set_quantized(self.engine.pool, p, name, q, scale)

    def _cpu_slots(self):
        return [p for p in range(self.num_experts) if not bool(self.gpu_experts_mask[p])]

    def _logical(self, mapping, p: int) -> int:
        e = p if mapping is None else int(mapping[p])
        if not 0 <= e < self.num_experts:
            raise ConfigError(f"physical_to_logical_map[{p}] = {e} is outside [0, {self.num_experts})")
        return e

    # ---- forward ----
    def submit_forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None):
        """Queue this layer for hidden_states [.., H] with topk_ids/topk_weights [T, K]; returns at once.
        Inputs are copied, so the caller may change them afterwards. Raises ConfigError on bad shapes/ids."""
        return self._submit(hidden_states, topk_ids, topk_weights, cuda_stream, borrow=False)

    def _submit(self, hidden_states, topk_ids, topk_weights, cuda_stream, borrow: bool):
        """submit_forward; ``borrow``: CPU inputs already in the kernels' dtypes are read in place, not copied
        (only when nothing reads them after sync_forward returns: forward() without expert deferral)."""
        import torch

        take = _cpu_view if borrow else _cpu_copy
        if self._inflight is not None or self._stream.inflight:
            raise ConfigError(f"layer {self.layer_idx}: submit_forward called twice without sync_forward")
        x = hidden_states.reshape(-1, self.hidden_size)
        if x.shape[0] > self.chunked_prefill_size:
            raise ConfigError(
                f"{x.shape[0]} tokens exceed chunked_prefill_size={self.chunked_prefill_size}; "
                "raise --chunked-prefill-size or send smaller chunks"
            )
        if x.device.type != "cpu" or self.cfg.staging == "always":
            return self._stream.submit(hidden_states, topk_ids, topk_weights, cuda_stream)
        x = take(torch, x, torch.bfloat16 if x.dtype != torch.float32 else torch.float32)
        ids = take(torch, topk_ids, torch.int64).reshape(x.shape[0], -1)
        w = take(torch, topk_weights, torch.float32).reshape(x.shape[0], -1)
        now, later = deferral.split(ids, w, self.num_experts, self.max_deferred_experts_per_token)
        eng, pool = self.engine, self.engine.pool
        with eng.lock:
            prev = eng.pending.pop(self.layer_idx, None)
            if prev is not None and tuple(prev.out.shape) != (x.shape[0], self.hidden_size):
                log.warning(
                    "layer %d: dropping deferred experts of a %s batch (now %d tokens)",
                    self.layer_idx,
                    tuple(prev.out.shape),
                    x.shape[0],
                )
                pool.wait(prev.ticket)  # its arrays must outlive its job
                prev = None
            out = prev.out if prev is not None else torch.empty(x.shape[0], self.hidden_size)
            ticket = self.layer.submit(pool, _np(x), _np(now), _np(w), self.skip_mask, _np(out), prev is not None)
            if later is not None:
                stale = eng.pending.pop(self.layer_idx + 1, None)
                if stale is not None:  # never consumed (e.g. a forward abandoned mid-model)
                    pool.wait(stale.ticket)
                nxt = torch.empty_like(out)
                t2 = self.layer.submit(pool, _np(x), _np(later), _np(w), self.skip_mask, _np(nxt), False)
                eng.pending[self.layer_idx + 1] = Pending(t2, nxt, (x, later, w, self.layer))
        self._inflight = (ticket, out, (x, now, w, prev))

    def sync_forward(self, hidden_states, cuda_stream=None):
        """Wait for this layer's submitted work; returns [T, H] in hidden_states' dtype and device. Deferred
        experts of this layer keep running; the next layer's output includes them."""
        if self._stream.inflight:
            return self._stream.sync(hidden_states)
        if self._inflight is None:
            raise ConfigError(f"layer {self.layer_idx}: sync_forward without submit_forward")
        ticket, out, keep = self._inflight
        self._inflight = None
        if keep[3] is not None:  # the previous layer's deferred experts (ran first): surface their errors
            self.engine.pool.wait(keep[3].ticket)
        self.engine.pool.wait(ticket)
        return out.to(device=hidden_states.device, dtype=hidden_states.dtype)

    def forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None):
        """submit_forward + sync_forward. Without expert deferral nothing reads the inputs after it returns, so
        CPU inputs already in bf16/fp32, int64 ids and fp32 weights are read in place (no copies)."""
        self._submit(hidden_states, topk_ids, topk_weights, cuda_stream, borrow=not self.max_deferred_experts_per_token)
        return self.sync_forward(hidden_states, cuda_stream)

    def __del__(self):
        """A wrapper freed between submit and sync first waits for its job: the job reads our input copies."""
        inflight, self._inflight = getattr(self, "_inflight", None), None
        if inflight is not None:
            try:
                self.engine.pool.wait(inflight[0])
            except Exception:  # noqa: BLE001 - nobody is left to receive it
                pass

    # ---- kt-kernel's static buffer API (our buffers are per call; sizes are kept for callers that ask) ----
    @staticmethod
    def set_capture_batch_sizes(capture_bs: List[int]):
        _CaptureSizes.sizes = sorted({int(b) for b in capture_bs})

    @staticmethod
    def get_capture_batch_sizes() -> List[int]:
        return list(_CaptureSizes.sizes)

    @staticmethod
    def clear_buffer_cache():
        return None


def _cpu_view(torch, t, dtype):
    """``t`` itself when it is a contiguous CPU tensor in ``dtype`` (read in place), else a private copy."""
    if t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous():
        return t
    return _cpu_copy(torch, t, dtype)


def _cpu_copy(torch, t, dtype):
    """A private CPU copy of ``t`` in ``dtype``. CPU tensors already in ``dtype`` are copied by numpy (a third of
    ``Tensor.to(copy=True)``'s per-call cost, which decode pays for three small arrays per layer)."""
    if t.device.type != "cpu" or t.dtype != dtype:
        return t.to(device="cpu", dtype=dtype, copy=True)
    import numpy as np

    c = torch.from_numpy(np.array(_np(t)))
    return c.view(torch.bfloat16) if dtype == torch.bfloat16 else c


def _gpu_mask(torch, num_experts: int, mask, num_gpu_experts):
    if mask is not None:
        m = torch.as_tensor(mask).to(device="cpu", dtype=torch.bool).reshape(-1)
        if m.numel() != num_experts:
            raise ConfigError(f"gpu_experts_mask has {m.numel()} entries; need num_experts={num_experts}")
        if num_gpu_experts is not None and int(num_gpu_experts) not in (0, int(m.sum())):
            raise ConfigError(
                f"num_gpu_experts={num_gpu_experts} disagrees with gpu_experts_mask "
                f"({int(m.sum())} experts on the GPU); pass one of them"
            )
        return m.clone()
    n = int(num_gpu_experts or 0)
    if not 0 <= n <= num_experts:
        raise ConfigError(f"num_gpu_experts={n} must be in [0, num_experts={num_experts}]")
    m = torch.zeros(num_experts, dtype=torch.bool)
    m[:n] = True  # upstream SGLang: experts 0..n-1 run on the GPU (mask_cpu_expert_ids)
    return m
