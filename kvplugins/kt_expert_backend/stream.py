"""CPU experts for GPU callers, in stream order and CUDA-graph-safe (issue #14).

Per layer and forward, all on the caller's CUDA stream, nothing blocking the host thread:
  submit_forward: the deferral split on the device -> non_blocking device-to-host copies of the hidden states,
    routing ids and weights into pinned buffers -> a host function (``cudaLaunchHostFunc``) that queues the layer
    on the CPU pool when the stream reaches it (and one for the deferred experts, into the next layer's output);
  sync_forward: a host function that holds the stream until the layer's CPU work is done -> a non_blocking
    host-to-device copy of the result into a device buffer, which is returned.
The buffers are fixed per batch size (one set per size in ``set_capture_batch_sizes``, plus one for the last
other size) and alternate between two slots by layer parity (the deferred experts of layer L write into L+1's),
so a captured CUDA graph replays the same host functions on the same addresses. The host functions are native
(``kvplugins._moe``: ``host_submit_fn``/``host_wait_fn`` on a ``HostJob``), so the driver's callback thread never
takes the GIL.

On the CPU (``KTConfig.staging='always'``) the same buffers, jobs and host functions run through
``HostOrder``, which performs each step at once in program order: what CI runs in place of a CUDA stream.
Source followed: kt-kernel 0.7.2 ``kt_kernel/experts_base.py`` (KExpertsCPUBuffer, submit_with_cuda_stream /
sync_with_cuda_stream) and SGLang 0.5.23 ``kt_ep_wrapper.py`` (the stream it passes).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from kvplugins.errors import ConfigError, NativeError
from kvplugins.kt_expert_backend import deferral, native
from kvplugins.transfer import device

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class HostOrder:
    """The CPU ordering shim of a stream: copies on CPU tensors are synchronous, and each host function is called
    when it is enqueued, on the calling thread (the order a CUDA stream would run them in)."""

    def host_fn(self, fn: int, handle: int) -> None:
        _HOST_FN(fn)(handle)

    def retire_event(self):
        return None


class CudaOrder:
    """A CUDA stream (the raw ``cudaStream_t`` the caller passed): host functions go through cudaLaunchHostFunc,
    which CUDA graph capture records as host nodes."""

    def __init__(self, stream_ptr: int):
        self._ptr = ctypes.c_void_p(int(stream_ptr))
        self._launch = _cudart().cudaLaunchHostFunc
        self._launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._launch.restype = ctypes.c_int

    def host_fn(self, fn: int, handle: int) -> None:
        rc = self._launch(self._ptr, ctypes.c_void_p(fn), ctypes.c_void_p(handle))
        if rc != 0:
            raise NativeError(f"cudaLaunchHostFunc returned CUDA error {rc}; the CPU experts were not queued")

    def retire_event(self):
        import torch

        ev = torch.cuda.Event()
        ev.record()
        return ev


def _cudart():
    lib = device.cuda_runtime(load=True)
    if lib is None:
        raise ConfigError(
            "CPU experts for a CUDA caller need the CUDA runtime (libcudart) that torch loads; install "
            "a CUDA build of torch, or run the model on the CPU"
        )
    return lib


@dataclass
class Buffers:
    """One batch size's fixed host buffers, two slots each: x [T, H] (bf16 or float32), now/later [T, K] int64,
    w [T, K] float32, out [T, H] float32 (pinned on CUDA), out_dev [T, H] in the caller's dtype on its device;
    ``jobs``: (layer index, slot, kind) -> the HostJob bound to them."""

    x: list
    now: list
    later: list
    w: list
    out: list
    out_dev: list
    jobs: dict = field(default_factory=dict)


@dataclass
class StreamState:
    """The engine's stream-path state (shared by every layer, like kt-kernel's KExpertsCPUBuffer): buffers per
    batch size, buffers being retired (freed once the stream passed ``event``), and per batch size the deferred
    job waiting for its target layer."""

    sizes: dict = field(default_factory=dict)  # key -> Buffers
    retired: list = field(default_factory=list)  # (event or None, Buffers)
    deferred: dict = field(default_factory=dict)  # T -> (target layer index, HostJob)


def order_for(device, cuda_stream):
    """The ordering of a caller on ``device``: CudaOrder (its stream, else torch's current one) or HostOrder."""
    if device.type == "cuda":
        import torch

        return CudaOrder(cuda_stream if cuda_stream is not None else torch.cuda.current_stream(device).cuda_stream)
    if device.type == "cpu":
        return HostOrder()
    raise ConfigError(
        f"hidden_states on {device}: the kvplugins kt backend serves CPU and CUDA callers; run the "
        "model on CUDA or the CPU"
    )


class StreamPath:
    """One layer's stream-ordered CPU experts. Lifecycle per forward, in layer order: submit -> sync."""

    def __init__(self, wrapper, captured_sizes):
        self.w, self._captured = wrapper, captured_sizes
        self._submit_fn, self._wait_fn = native.host_functions()
        self._inflight = None

    def submit(self, hidden_states, topk_ids, topk_weights, cuda_stream) -> None:
        import torch

        w, eng = self.w, self.w.engine
        x = hidden_states.reshape(-1, w.hidden_size)
        T = x.shape[0]
        order = order_for(x.device, cuda_stream)
        bufs = self._buffers(torch, eng.stream, x, T, order)
        slot, nxt = w.layer_idx % 2, (w.layer_idx + 1) % 2
        ids = topk_ids.reshape(T, -1).to(torch.int64)
        wt = topk_weights.reshape(T, -1).to(torch.float32)
        now, later = deferral.split(ids, wt, w.num_experts, w.max_deferred_experts_per_token)
        bufs.x[slot].copy_(x, non_blocking=True)
        bufs.w[slot].copy_(wt, non_blocking=True)
        bufs.now[slot].copy_(now, non_blocking=True)
        pending = eng.stream.deferred.pop(T, None)
        prev = pending[1] if pending is not None and pending[0] == w.layer_idx else None
        job = self._job(bufs, slot, "now", bufs.now[slot], bufs.out[slot], accumulate=prev is not None)
        _raise_failed(w.layer_idx, job, prev)
        order.host_fn(self._submit_fn, job.handle)
        if later is not None:
            bufs.later[slot].copy_(later, non_blocking=True)
            job2 = self._job(bufs, slot, "later", bufs.later[slot], bufs.out[nxt], accumulate=False)
            _raise_failed(w.layer_idx, job2)
            order.host_fn(self._submit_fn, job2.handle)
            eng.stream.deferred[T] = (w.layer_idx + 1, job2)
        self._inflight = (job, prev, bufs, slot, order)

    def sync(self, hidden_states):
        """Hold the stream until this layer's CPU work (and the deferred part before it) is done, then copy the
        result to the caller's device. Returns [T, H] in hidden_states' dtype: a fixed buffer, valid until
        the sync of layer index + 2 with the same batch size (the caller consumes it before)."""
        job, prev, bufs, slot, order = self._inflight
        self._inflight = None
        if prev is not None:
            order.host_fn(self._wait_fn, prev.handle)
        order.host_fn(self._wait_fn, job.handle)
        if isinstance(order, HostOrder):  # the work is done now: report a failure at once
            _raise_failed(self.w.layer_idx, job, prev)
        out = bufs.out_dev[slot]
        out.copy_(bufs.out[slot], non_blocking=True)
        return out

    @property
    def inflight(self) -> bool:
        return self._inflight is not None

    def _job(self, bufs: Buffers, slot: int, kind: str, ids, out, accumulate: bool):
        key = (self.w.layer_idx, slot, kind, accumulate)
        job = bufs.jobs.get(key)
        if job is None:
            w = self.w
            x = bufs.x[slot]
            arrays = (numpy_view(x), numpy_view(ids), numpy_view(bufs.w[slot]), numpy_view(out))
            job = bufs.jobs[key] = native.HostJob(
                w.layer,
                w.engine.pool,
                *arrays[:3],
                w.skip_mask,
                arrays[3],
                accumulate,
                (x, ids, bufs.w[slot], out, arrays),
            )
        return job

    def _buffers(self, torch, st: StreamState, x, T: int, order) -> Buffers:
        """The fixed buffers of batch size ``T`` (made once; a size outside the captured ones replaces the last
        such size's set, retired once the stream has passed its last use)."""
        xd = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
        key = (T, x.shape[1], self.w.num_experts_per_tok, str(x.device), x.dtype)
        bufs = st.sizes.get(key)
        if bufs is not None:
            return bufs
        st.retired = [(ev, b) for ev, b in st.retired if ev is not None and not ev.query()]
        if T not in self._captured():
            for k in [k for k in st.sizes if k[0] not in self._captured()]:
                st.retired.append((order.retire_event(), st.sizes.pop(k)))
        pin = x.device.type == "cuda"
        K, H = self.w.num_experts_per_tok, x.shape[1]

        def host(shape, dtype, fill=0):
            return [torch.full(shape, fill, dtype=dtype, pin_memory=pin) for _ in range(2)]

        bufs = st.sizes[key] = Buffers(
            host((T, H), xd),
            host((T, K), torch.int64, -1),
            host((T, K), torch.int64, -1),
            host((T, K), torch.float32),
            host((T, H), torch.float32),
            [torch.empty((T, H), dtype=x.dtype, device=x.device) for _ in range(2)],
        )
        return bufs


def _raise_failed(layer_idx: int, *jobs) -> None:
    """Raise NativeError if a host function of these jobs failed (the stream ran on without the result)."""
    for job in jobs:
        err = job.take_error() if job is not None else ""
        if err:
            raise NativeError(f"layer {layer_idx}: CPU experts failed in a stream host function: {err}")


def numpy_view(t):
    """A numpy view of CPU tensor ``t`` (bf16 as uint16 bits; no copy). The native layer reads numpy through the
    buffer protocol, several µs per array cheaper than torch's Python-level ``__dlpack__``: a decode forward
    passes five arrays."""
    import torch

    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()
