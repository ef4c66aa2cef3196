"""``kvplugins kt convert``: HF safetensors (bf16/fp16, or fp8 with 128x128 block scales ``weight_scale_inv``)
-> the converted format of weights.py, one file per MoE layer, with tqdm progress bars.

Expert tensors recognised: per-expert ``layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` (Qwen2/3-MoE,
DeepSeek-V2/V3) and fused ``layers.L.mlp.experts.{gate_up_proj,down_proj}`` (transformers 5 layout).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvplugins.errors import ConfigError
from kvplugins.kt_expert_backend import native, weights

PER_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
FUSED = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
FP8_BLOCK = 128


def model_shape(hf_dir: Path) -> tuple[int, int, int]:
    """(num_experts, hidden_size, moe_intermediate_size) from config.json."""
    try:
        cfg = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{hf_dir}/config.json cannot be read ({e}); --input must be a HF model directory") from e
    cfg = cfg.get("text_config", cfg)
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    inter = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    if not experts or not inter:
        raise ConfigError(f"{hf_dir}/config.json names no routed experts (num_experts / n_routed_experts)")
    return int(experts), int(cfg["hidden_size"]), int(inter)


class _Index:
    """Which safetensors file holds each tensor; tensors are read one at a time (memory stays ~one expert)."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{hf_dir} has no *.safetensors files")
        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}

    def get(self, key: str):
        import torch

        t = self.where[key].get_tensor(key)
        scale_key = key + "_scale_inv" if not key.endswith(".weight") else key[: -len(".weight")] + ".weight_scale_inv"
        if t.dtype == torch.float8_e4m3fn:
            if scale_key not in self.where:
                raise ConfigError(f"{key} is fp8 but {scale_key} is missing")
            s = self.where[scale_key].get_tensor(scale_key).float()
            s = s.repeat_interleave(FP8_BLOCK, 0)[: t.shape[0]].repeat_interleave(FP8_BLOCK, 1)[:, : t.shape[1]]
            return (t.float() * s).to(torch.bfloat16)
        return t if t.dtype in (torch.bfloat16, torch.float32) else t.to(torch.bfloat16)


def _layers(index: _Index) -> dict[int, str]:
    found = {}
    for k in index.where:
        m = PER_EXPERT.search(k) or FUSED.search(k)
        if m:
            found[int(m.group(1))] = "fused" if m.re is FUSED else "per_expert"
    return dict(sorted(found.items()))


def _expert_mats(index: _Index, layer: int, kind: str, e: int, prefix: dict, inter: int):
    if kind == "per_expert":
        p = prefix[layer]
        return {n: index.get(f"{p}layers.{layer}.mlp.experts.{e}.{n}_proj.weight") for n in weights.PROJS}
    p = prefix[layer]
    gu = index.get(f"{p}layers.{layer}.mlp.experts.gate_up_proj")[e]
    return {"gate": gu[:inter], "up": gu[inter:], "down": index.get(f"{p}layers.{layer}.mlp.experts.down_proj")[e]}


def convert(
    hf_dir, out_dir, method: str, group: int = 128, threadpool_count: int = 1, progress: bool = True
) -> weights.Meta:
    """Convert every MoE layer's routed experts. method: bf16 | int8 | int4. Returns the written Meta.
    threadpool_count is accepted for kt-kernel CLI parity: NUMA placement happens at load (first touch)."""
    try:
        import safetensors  # noqa: F401
        import torch  # noqa: F401
        from tqdm import tqdm
    except ImportError as e:
        raise ConfigError(
            f"`kvplugins kt convert` needs torch, safetensors and tqdm ({e}); install them into this "
            "environment (SGLang installs all three)"
        ) from e
    if method not in native.FORMATS:
        raise ConfigError(f"--method {method!r} is not one of {', '.join(native.FORMATS)}")
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    E, H, I = model_shape(hf_dir)
    index = _Index(hf_dir)
    layers = _layers(index)
    if not layers:
        raise ConfigError(f"{hf_dir} holds no routed-expert tensors (layers.L.mlp.experts.*)")
    prefix = {}
    for k in index.where:
        m = PER_EXPERT.search(k) or FUSED.search(k)
        if m:
            prefix[int(m.group(1))] = k[: m.start() + 1] if m.start() else ""  # "model." etc.
    out_dir.mkdir(parents=True, exist_ok=True)
    for layer, kind in tqdm(layers.items(), desc=f"convert {method}", unit="layer", disable=not progress):
        tensors = {}
        for e in tqdm(range(E), desc=f"layer {layer}", unit="expert", leave=False, disable=not progress):
            for name, m in _expert_mats(index, layer, kind, e, prefix, I).items():
                q, s = native.quantize(method, m.contiguous(), group)
                tensors[f"{e}.{name}.q"] = q
                if method != "bf16":
                    tensors[f"{e}.{name}.scale"] = s
        weights.save_layer(out_dir, layer, tensors)
    meta = weights.Meta(method, group if method == "int4" else 0, E, H, I, list(layers))
    weights.write_meta(out_dir, meta)
    return meta
