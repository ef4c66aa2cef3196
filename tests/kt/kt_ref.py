"""Torch reference for the routed-expert MoE (fp32 math), and weight builders for the kt tests."""

from __future__ import annotations

import torch

from kvplugins.kt_expert_backend import native


def ref_moe(x, ids, weights, gate, up, down, skip=None):
    """out[t] = sum_k w[t,k] * down_e @ (silu(gate_e @ x_t) * (up_e @ x_t)), e = ids[t,k]; fp32. ids -1 skipped."""
    x = x.float()
    out = torch.zeros(x.shape[0], down.shape[1])
    for e in ids.unique().tolist():
        if e < 0 or (skip is not None and bool(skip[e])):
            continue
        t, k = (ids == e).nonzero(as_tuple=True)
        xe = x[t]
        h = torch.nn.functional.silu(xe @ gate[e].float().T) * (xe @ up[e].float().T)
        out.index_add_(0, t, weights[t, k].float()[:, None] * (h @ down[e].float().T))
    return out


def random_experts(E, H, I, seed=0, scale=0.05):
    """bf16 gate/up [E, I, H] and down [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16)  # noqa: E731
    return mk(E, I, H), mk(E, I, H), mk(E, H, I)


def dequantized(fmt, w, group=128):
    """What the kernels compute with: quantize then dequantize each expert matrix (float32 torch)."""
    out = []
    for m in w:
        q, s = native.quantize(fmt, m, group)
        out.append(torch.from_numpy(native.dequantize(fmt, q, s, group)))
    return torch.stack(out)


def routing(T, E, K, seed=1):
    """Distinct experts per token and softmax-like positive weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return ids, (w / w.sum(1, keepdim=True)).float()


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def loaded_wrapper(layer_idx, experts, deferred=0, num_gpu=1, E=8, H=256, I=128, K=4):
    """A KTMoEWrapper (SGLang 0.5.23's call, BF16, 2 threads) with ``experts`` (gate, up, down) loaded."""
    from kvplugins.kt_expert_backend import KTMoEWrapper

    w = KTMoEWrapper(
        layer_idx=layer_idx,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        num_gpu_experts=num_gpu,
        cpuinfer_threads=2,
        threadpool_count=1,
        weight_path="",
        chunked_prefill_size=64,
        method="BF16",
        max_deferred_experts_per_token=deferred,
    )
    w.load_weights_from_tensors(*experts)
    return w
