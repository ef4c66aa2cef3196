"""`kvplugins kt convert` on synthetic checkpoints: the fused transformers-5 layout and fp8 with 128x128 block
scales (DeepSeek-V3 style) give the same converted weights as the bf16 per-expert source."""

import json

import torch
from safetensors.torch import save_file

from kt_ref import random_experts, rel_err
from kvplugins.kt_expert_backend import native, weights
from kvplugins.kt_expert_backend.convert import convert

E, H, I = 4, 256, 192


def _hf_dir(path, tensors):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": H, "moe_intermediate_size": I, "n_routed_experts": E}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _fp8_block(w):
    """bf16 [N, K] -> (fp8 e4m3 weight, float32 scale_inv [ceil(N/128), ceil(K/128)])."""
    N, K = w.shape
    s = torch.zeros((N + 127) // 128, (K + 127) // 128)
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            s[i, j] = blk.abs().max() / 448.0
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def _deq(root, layer, e, proj):
    q, s = weights.LayerReader(root, layer).get(e, proj)
    return torch.from_numpy(native.dequantize("bf16", q, s))


def test_fused_and_fp8_layouts(tmp_path):
    gate, up, down = random_experts(E, H, I, seed=31)
    fused = _hf_dir(
        tmp_path / "fused",
        {
            "model.layers.3.mlp.experts.gate_up_proj": torch.cat([gate, up], 1),
            "model.layers.3.mlp.experts.down_proj": down,
        },
    )
    meta = convert(fused, tmp_path / "out_fused", "bf16", progress=False)
    assert meta.layers == [3] and meta.num_experts == E
    for e in range(E):
        assert torch.equal(_deq(tmp_path / "out_fused", 3, e, "up"), up[e].float())
    t = {}
    for e in range(E):
        for name, m in (("gate", gate), ("up", up), ("down", down)):
            q, s = _fp8_block(m[e])
            t[f"model.layers.0.mlp.experts.{e}.{name}_proj.weight"] = q
            t[f"model.layers.0.mlp.experts.{e}.{name}_proj.weight_scale_inv"] = s
    fp8 = _hf_dir(tmp_path / "fp8", t)
    convert(fp8, tmp_path / "out_fp8", "bf16", progress=False)
    for e in range(E):
        assert rel_err(_deq(tmp_path / "out_fp8", 0, e, "down"), down[e]) < 0.05  # e4m3 rounding only
