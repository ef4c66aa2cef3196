"""The MoE backends moe_bench.py compares, each built from the same bf16 expert weights and called the same way:
``fn(x [T, H] bf16, ids [T, K] int64, weights [T, K] float32) -> [T, H]``.

- kvplugins: KTMoEWrapper (this repo) with --kt-method BF16 / AMXINT8 / AMXINT4.
- kt-kernel 0.7.2 (PyPI, installed by ci/install-kt.sh into .venv/kt-kernel-0.7.2): the same three methods.
  BENCHMARK ENV ONLY: CPU-only torch has no pinned-memory allocator, so ``pin_memory=True`` (kt-kernel's staging
  buffers) is dropped, and KT_FORCE_SYNC_SUBMIT=1 selects kt-kernel's synchronous (non-CUDA-stream) path.
- torch: the HF-style per-expert loop in bf16 (oneDNN matmuls), the reference dense implementation.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
KT_DIR = ROOT / ".venv" / "kt-kernel-0.7.2"
METHODS = {"bf16": "BF16", "int8": "AMXINT8", "int4": "AMXINT4"}


def weight_bytes(fmt: str, E_touched: int, H: int, I: int, group: int = 128) -> int:
    """Bytes of expert weights (and scales) read for E_touched experts."""
    n = 3 * H * I
    if fmt == "bf16":
        return E_touched * n * 2
    if fmt == "int8":
        return E_touched * (n + 4 * (2 * I + H))
    return E_touched * (n // 2 + 4 * n // group)


def kvplugins_backend(fmt, w, K, threads):
    from kvplugins.kt_expert_backend import KTMoEWrapper

    gate, up, down = w
    E, I, H = gate.shape
    m = KTMoEWrapper(
        layer_idx=0,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        num_gpu_experts=0,
        cpuinfer_threads=threads,
        threadpool_count=1,
        weight_path="",
        chunked_prefill_size=1024,
        method=METHODS[fmt],
    )
    m.load_weights_from_tensors(gate, up, down, torch.arange(E))
    return lambda x, ids, wt: m.forward(x, ids, wt, None)


def _kt_import():
    if not (KT_DIR / "kt_kernel").exists():
        raise RuntimeError(f"kt-kernel 0.7.2 is not installed in {KT_DIR}; run `bash ci/install-kt.sh`")
    os.environ["KT_FORCE_SYNC_SUBMIT"] = "1"
    if str(KT_DIR) not in sys.path:
        sys.path.insert(0, str(KT_DIR))
    for name in ("zeros", "empty", "full"):
        fn = getattr(torch, name)
        if not isinstance(fn, functools.partial):
            setattr(torch, name, functools.partial(_no_pin, fn))
    from kt_kernel import KTMoEWrapper

    return KTMoEWrapper


def _no_pin(orig, *a, **k):
    k.pop("pin_memory", None)
    return orig(*a, **k)


def kt_backend(fmt, w, K, threads, layer_idx):
    KT = _kt_import()
    gate, up, down = w
    E, I, H = gate.shape
    tmp = tempfile.mkdtemp(prefix="kt-bench-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # up to 1.1 GB per run (bf16 safetensors, kt's dumps)
    if fmt == "bf16":  # kt-kernel's BF16 path reads HF-style safetensors (BF16SafeTensorLoader)
        from safetensors.torch import save_file

        save_file(
            {
                f"model.layers.{layer_idx}.mlp.experts.{e}.{n}_proj.weight": t[e].contiguous()
                for e in range(E)
                for n, t in (("gate", gate), ("up", up), ("down", down))
            },
            f"{tmp}/model.safetensors",
        )
    m = KT(
        layer_idx=layer_idx,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        gpu_experts_mask=None,
        cpuinfer_threads=threads,
        threadpool_count=1,
        weight_path=tmp,
        chunked_prefill_size=1024,
        method=METHODS[fmt],
    )
    if fmt == "bf16":
        m.load_weights(torch.arange(E))
    else:
        m.load_weights_from_tensors(gate, up, down, torch.arange(E))
    return lambda x, ids, wt: m.forward(x, ids, wt, 0)


def torch_backend(w):
    gate, up, down = w

    def run(x, ids, wt):
        out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32)
        for e in ids.unique().tolist():
            t, k = (ids == e).nonzero(as_tuple=True)
            xe = x[t]
            h = torch.nn.functional.silu(xe @ gate[e].T) * (xe @ up[e].T)
            out.index_add_(0, t, (h @ down[e].T).float() * wt[t, k, None])
        return out.to(torch.bfloat16)

    return run
