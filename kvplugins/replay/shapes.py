"""KV bytes of one block of tokens for a model shape: what one stored object holds at full scale.

Shapes follow each model's Hugging Face ``config.json``: Llama-3-8B (32 layers, 8 KV heads, head dim 128),
Llama-3-70B (80, 8, 128), Qwen3-30B-A3B (48, 4, 128), DeepSeek-V3 (61 layers of MLA: one latent of
kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token and layer, no separate K and V).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplugins.errors import ConfigError

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class Shape:
    """layers, kv_heads x head_dim per K and per V (or ``latent`` values per token and layer for MLA), dtype."""

    layers: int
    kv_heads: int = 0
    head_dim: int = 0
    dtype: str = "bfloat16"
    latent: int = 0

    def block_bytes(self, tokens: int) -> int:
        """Bytes of KV of ``tokens`` tokens (all layers)."""
        per_token_layer = self.latent if self.latent else 2 * self.kv_heads * self.head_dim
        return tokens * self.layers * per_token_layer * DTYPE_BYTES[self.dtype]


SHAPES = {
    "llama3-8b": Shape(32, 8, 128),
    "llama3-70b": Shape(80, 8, 128),
    "qwen3-30b-a3b": Shape(48, 4, 128),
    "deepseek-v3": Shape(61, latent=576),
}


def resolve(name: str, layers: int = 0, kv_heads: int = 0, head_dim: int = 0, dtype: str = "") -> Shape:
    """The named shape, or an explicit one when ``layers`` > 0. Raises ConfigError naming the choices."""
    if layers > 0:
        if kv_heads <= 0 or head_dim <= 0:
            raise ConfigError(
                f"an explicit model shape needs --kv-heads and --head-dim > 0 (got {kv_heads}, "
                f"{head_dim}) with --layers {layers}"
            )
        dtype = dtype or "bfloat16"
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"--kv-dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        return Shape(layers, kv_heads, head_dim, dtype)
    if name not in SHAPES:
        raise ConfigError(
            f"--model-shape {name!r} is not one of {', '.join(SHAPES)}; or give --layers, "
            "--kv-heads, --head-dim and --kv-dtype"
        )
    return SHAPES[name]
