"""CPU experts called from CUDA (kt_expert_backend/stream.py): on the caller's stream and under CUDA graph capture
and replay, the outputs equal the CPU direct path's, and submit_forward does not wait for the GPU. Skipped without
a GPU (conftest.py); CI runs the same path on CPU (tests/kt/test_kt_stream.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kt"))
from kt_ref import loaded_wrapper, random_experts, routing  # noqa: E402

from kvplugins.kt_expert_backend import KTMoEWrapper  # noqa: E402

E, H, I, K = 8, 256, 128, 4


def wrappers(first_idx: int, experts) -> list[KTMoEWrapper]:
    return [loaded_wrapper(first_idx + i, experts, d) for i, d in enumerate((2, 0))]


def two_layers(ws, xs, ids, wts, stream) -> list[torch.Tensor]:
    outs = []
    for w, x, i, wt in zip(ws, xs, ids, wts):
        w.submit_forward(x, i, wt, stream)
        outs.append(w.sync_forward(x, stream))
    return outs


def test_cuda_stream_path_matches_cpu_and_does_not_block_the_host():
    experts = random_experts(E, H, I, seed=31)
    cpu, gpu = wrappers(1000, experts), wrappers(1010, experts)
    for T in (1, 3, 8):
        xs = [torch.randn(T, H).to(torch.bfloat16) for _ in cpu]
        rts = [routing(T, E, K, seed=T + j) for j in range(len(cpu))]
        want = two_layers(cpu, xs, [r[0] for r in rts], [r[1] for r in rts], None)
        want = [t.clone() for t in want]
        stream = torch.cuda.current_stream().cuda_stream
        dx, dids, dwts = [x.cuda() for x in xs], [r[0].cuda() for r in rts], [r[1].cuda() for r in rts]
        two_layers(gpu, dx, dids, dwts, stream)  # first call of this size: makes its pinned buffers and jobs
        torch.cuda._sleep(200_000_000)  # a long kernel ahead on the stream
        t0 = time.perf_counter()
        got = two_layers(gpu, dx, dids, dwts, stream)
        enqueue_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        assert all(torch.equal(a, b.cpu()) for a, b in zip(want, got)), f"T={T}"
        assert enqueue_s < 0.05, f"submit/sync blocked the host for {enqueue_s:.3f} s behind the GPU"


def test_captured_graph_replays_with_new_inputs():
    experts = random_experts(E, H, I, seed=32)
    cpu, gpu = wrappers(1020, experts), wrappers(1030, experts)
    KTMoEWrapper.set_capture_batch_sizes([4])
    try:
        T = 4
        xs = [torch.zeros(T, H, dtype=torch.bfloat16, device="cuda") for _ in gpu]
        ids = [torch.zeros(T, K, dtype=torch.int64, device="cuda") for _ in gpu]
        wts = [torch.zeros(T, K, dtype=torch.float32, device="cuda") for _ in gpu]
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            two_layers(gpu, xs, ids, wts, stream.cuda_stream)  # warm-up: buffers and jobs exist
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = two_layers(gpu, xs, ids, wts, stream.cuda_stream)
        for seed in range(3):
            new_x = [torch.randn(T, H).to(torch.bfloat16) for _ in gpu]
            new_r = [routing(T, E, K, seed=50 + seed + j) for j in range(len(gpu))]
            for dst, src in zip(xs, new_x):
                dst.copy_(src)
            for j, (i, wt) in enumerate(new_r):
                ids[j].copy_(i), wts[j].copy_(wt)
            graph.replay()
            torch.cuda.synchronize()
            want = two_layers(cpu, new_x, [r[0] for r in new_r], [r[1] for r in new_r], None)
            assert all(torch.equal(a, b.cpu()) for a, b in zip(want, outs)), f"replay {seed}"
    finally:
        KTMoEWrapper.set_capture_batch_sizes([])
