"""Pool bytes and objects per page at TP 1/2/4/8 (issue #32), computed from the connector's real key spaces.

For each model shape and TP size, every TP rank's key spaces are built the way the vLLM connector's workers
build them (``kvplugins.layout.shards.rank_heads`` + ``KeySpace``: MLA groups replicated, one space; MHA/GQA
groups one space per KV head) and counted: distinct key spaces x page part bytes = pool bytes per page, and the
objects one rank moves per page. Compared with the connector before issue #32 (every rank its own key space:
MLA stored once per rank, MHA/GQA objects readable only at the writer's TP size) and LMCache's documented
behaviour (MLA saved by the first rank only; otherwise one chunk per rank, keyed by the worker's rank and world
size: ``LMCacheEngineMetadata`` worker_id/world_size, "save_only_first_rank" for MLA).

Shapes (public configs): DeepSeek-V3 (MLA: 61 layers, latent 512 + rope 64, bf16, 64-token blocks as vLLM's
GPU MLA backends use) and Llama-3-70B (GQA: 80 layers, 8 KV heads of 128, bf16, 16-token blocks).
Prints a markdown table; no engine runs (the TP 1-2 figures measured on real engines are in
tests/vllm/test_parallel_e2e.py and docs/benchmarks.md).

    .venv/bin/python benchmarks/parallel_keyspace.py
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplugins.layout import KeySpace
from kvplugins.layout.shards import rank_heads


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int  # 0 for MLA (one latent per token, the same on every rank)
    token_bytes_per_layer: int  # bytes of one token's KV in one layer, all heads (K and V, or the latent)
    block: int

    def page_bytes(self) -> int:
        return self.layers * self.token_bytes_per_layer * self.block


SHAPES = [
    Shape("DeepSeek-V3 (MLA)", 61, 0, (512 + 64) * 2, 64),
    Shape("Llama-3-70B (GQA, 8 KV heads)", 80, 8, 2 * 8 * 128 * 2, 16),
]


def spaces(shape: Shape, tp: int, per_rank: bool) -> dict[int, list[KeySpace]]:
    """TP rank -> the key spaces it writes (ours, or ``per_rank``: the connector before issue #32)."""
    page = shape.page_bytes()
    base = KeySpace(
        model=shape.name,
        kv_dtype="bfloat16",
        block_size=shape.block,
        layer_group="all",
        tp_rank=0,
        tp_size=1,
        page_bytes=page,
    )
    out = {}
    for r in range(tp):
        if per_rank:
            out[r] = [
                KeySpace(
                    **{
                        **base.__dict__,
                        "tp_rank": r,
                        "tp_size": tp,
                        "page_bytes": page // tp if shape.kv_heads else page,
                    }
                )
            ]
        elif not shape.kv_heads:  # MLA: one space, TP rank 0 writes
            out[r] = [base] if r == 0 else []
        else:  # one space per KV head; a replica rank writes nothing
            h = rank_heads(r, tp, shape.kv_heads)
            out[r] = (
                [
                    KeySpace(
                        **{
                            **base.__dict__,
                            "tp_rank": h.first + j,
                            "tp_size": shape.kv_heads,
                            "page_bytes": page // shape.kv_heads,
                        }
                    )
                    for j in range(h.count)
                ]
                if h.writes
                else []
            )
    return out


def row(shape: Shape, tp: int) -> list[str]:
    tokens = shape.block
    ours, before = spaces(shape, tp, False), spaces(shape, tp, True)
    pool = sum(k.page_bytes for k in {k for ks in ours.values() for k in ks}) / tokens
    pool_before = sum(k.page_bytes for k in {k for ks in before.values() for k in ks}) / tokens
    objects = rank_heads(0, tp, shape.kv_heads).count if shape.kv_heads else 1
    lmcache = shape.page_bytes() / tokens  # MLA: first rank only; GQA: each rank its heads' share
    readable = "any TP" if not shape.kv_heads else f"TP dividing {shape.kv_heads} or a multiple of it"
    return [
        shape.name,
        str(tp),
        f"{pool:,.0f}",
        f"{pool_before:,.0f}",
        f"{lmcache:,.0f}",
        f"{pool:,.0f}",
        f"{pool_before:,.0f}",
        str(objects),
        "1",
        readable,
        f"TP {tp} only",
    ]


def main() -> None:
    head = [
        "model",
        "TP",
        "pool B/token (ours)",
        "before #32",
        "LMCache",
        "write B/prefilled token (ours)",
        "before #32",
        "objects/page/rank (ours)",
        "before #32",
        "readable at (ours)",
        "before #32",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for shape in SHAPES:
        for tp in (1, 2, 4, 8) + ((16,) if shape.kv_heads else ()):
            print("| " + " | ".join(row(shape, tp)) + " |")


if __name__ == "__main__":
    main()
