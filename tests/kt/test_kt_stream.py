"""The stream-ordered CPU-expert path of GPU callers (kt_expert_backend/stream.py), run on the CPU with staging
forced (KVPLUGINS_KT_STAGING=always): the same fixed buffers, native HostJobs and host functions a CUDA stream or
a replayed CUDA graph calls, in program order. It must give exactly the direct path's outputs over T = 1..8 with
deferral on, keep one buffer set per captured batch size, copy inputs at submit, and report a failure in a host
function as an error naming the layer. tests/gpu/ runs it on a CUDA stream and under graph capture."""

import pytest
import torch

from kt_ref import loaded_wrapper, random_experts, routing
from kvplugins.errors import ConfigError, NativeError
from kvplugins.kt_expert_backend import KTMoEWrapper

E, H, I, K = 8, 256, 128, 4
DEFERRED = (2, 2, 0)  # three layers; the last defers nothing (as SGLang passes it)


@pytest.fixture(scope="module")
def experts():
    return random_experts(E, H, I, seed=21)


def layers(first_idx: int, experts, staging: str, monkeypatch) -> list[KTMoEWrapper]:
    monkeypatch.setenv("KVPLUGINS_KT_STAGING", staging)
    return [loaded_wrapper(first_idx + i, experts, d) for i, d in enumerate(DEFERRED)]


def run_model(ws, T: int, seed: int) -> list[torch.Tensor]:
    """One forward through the layers: each layer's output (cloned: the stream path returns fixed buffers)."""
    outs = []
    for i, w in enumerate(ws):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + i)).to(torch.bfloat16)
        ids, wt = routing(T, E, K, seed=seed + 100 + i)
        w.submit_forward(x, ids, wt, None)
        outs.append(w.sync_forward(x, None).clone())
    return outs


def test_stream_path_matches_the_direct_path_over_batch_sizes_with_deferral(experts, monkeypatch):
    direct, staged = layers(400, experts, "auto", monkeypatch), layers(500, experts, "always", monkeypatch)
    assert staged[0].cfg.staging == "always" and direct[0].cfg.staging == "auto"
    for T in range(1, 9):
        for rep in range(2):  # the second pass reuses the batch size's fixed buffers and jobs
            want, got = run_model(direct, T, 10 * T + rep), run_model(staged, T, 10 * T + rep)
            for layer, (a, b) in enumerate(zip(want, got)):
                assert b.dtype == torch.bfloat16 and b.shape == (T, H)
                assert torch.equal(a, b), f"T={T} layer {layer}: stream path differs from the direct path"
    assert not staged[0].engine.stream.deferred  # the last layer consumed every deferred part


def test_buffers_are_fixed_per_captured_batch_size(experts, monkeypatch):
    ws = layers(600, experts, "always", monkeypatch)
    KTMoEWrapper.set_capture_batch_sizes([2, 4])
    try:
        st = ws[0].engine.stream
        run_model(ws, 2, 1)
        first = {k: b.x[0].data_ptr() for k, b in st.sizes.items() if k[0] == 2}
        for T in (3, 4, 5, 2):
            run_model(ws, T, T)
        sizes = sorted(k[0] for k in st.sizes)
        assert 2 in sizes and 4 in sizes and 5 in sizes and 3 not in sizes  # 3 was replaced by 5 (not captured)
        assert {k: b.x[0].data_ptr() for k, b in st.sizes.items() if k[0] == 2} == first  # same addresses
    finally:
        KTMoEWrapper.set_capture_batch_sizes([])


def test_inputs_are_copied_at_submit(experts, monkeypatch):
    (w, *_), (ref, *_) = layers(700, experts, "always", monkeypatch), layers(710, experts, "auto", monkeypatch)
    x = torch.randn(4, H).to(torch.bfloat16)
    ids, wt = routing(4, E, K, seed=3)
    want = ref.forward(x.clone(), ids.clone(), wt.clone(), None)
    w.submit_forward(x, ids, wt, None)
    ids.fill_(-1), x.zero_(), wt.zero_()
    assert torch.equal(w.sync_forward(x, None), want)


def test_a_failing_host_job_names_the_layer(experts, monkeypatch):
    monkeypatch.setenv("KVPLUGINS_KT_STAGING", "always")
    w = KTMoEWrapper(
        layer_idx=800,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        num_gpu_experts=0,
        cpuinfer_threads=2,
        threadpool_count=1,
        weight_path="",
        chunked_prefill_size=64,
        method="BF16",
    )
    x = torch.randn(2, H).to(torch.bfloat16)
    ids, wt = routing(2, E, K, seed=5)
    w.submit_forward(x, ids, wt, None)  # no weights loaded: the job fails in the host function
    with pytest.raises(NativeError, match="layer 800: CPU experts failed in a stream host function"):
        w.sync_forward(x, None)


def test_an_unsupported_device_is_refused_by_name(experts, monkeypatch):
    (w, *_) = layers(900, experts, "auto", monkeypatch)
    x = torch.empty(2, H, dtype=torch.bfloat16, device="meta")
    ids = torch.zeros(2, K, dtype=torch.int64, device="meta")
    with pytest.raises(ConfigError, match="hidden_states on meta: the kvplugins kt backend serves CPU and CUDA"):
        w.submit_forward(x, ids, torch.zeros(2, K, device="meta"), None)
