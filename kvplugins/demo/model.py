"""Tiny random-weight models of real architectures and their tokenizer, built locally once: a Llama
(LlamaForCausalLM, the demo's), a Gemma-3 (Gemma3ForCausalLM: sliding-window and full-attention layers, a
hybrid KV cache in vLLM: two KV cache groups), an LFM2 (Lfm2ForCausalLM: gated short-convolution and
full-attention layers; vLLM keeps the convolution state in a Mamba KV cache group), a Qwen3-Next
(Qwen3NextForCausalLM: gated delta net linear attention, full attention, MoE; vLLM-CPU runs it in bf16 only) and
a Granite-4 hybrid (GraniteMoeHybridForCausalLM: Mamba2 and attention layers; vLLM-CPU cannot run it with
prefix caching, see tests/vllm/test_mamba_e2e.py) and a Mistral (MistralForCausalLM with a sliding window on every
layer, as Mistral-7B v0.1: one KV cache group, sliding) and a DeepSeek-V2 (DeepseekV2ForCausalLM: multi-head latent
attention, MLA, whose latent KV vLLM keeps once per TP rank, identical on each; dense MLPs; the latent and rope
widths of DeepSeek-V2/V3, 512 + 64, the only ones vLLM-CPU's MLA decode kernel runs).

No hub access: the tokenizer is a word-level tokenizer trained on the demo's conversation text and the
weights are random with a fixed seed, so every build is identical. float32 keeps greedy decoding stable
(argmax margins far above rounding noise). Cached under ``$XDG_CACHE_HOME/kvplugins/demo-model-v1``
(default ``~/.cache``); the directory appears atomically (built in a temp dir, then renamed).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kvplugins.demo.conversation import corpus

MODEL_DIR_NAME = "demo-model-v1"
FAMILY_DIRS = {
    "llama": MODEL_DIR_NAME,
    "llama-wide": "demo-llama-wide-v1",
    "gemma3": "demo-gemma3-v1",
    "lfm2": "demo-lfm2-v1",
    "qwen3next": "demo-qwen3next-v1",
    "granite4": "demo-granite4-v1",
    "mistral": "demo-mistral-v1",
    "deepseek-v2": "demo-deepseek-v2-v1",
}
GEMMA3_WINDOW = 128  # tokens: the sliding window of the tiny Gemma-3's sliding layers (4 blocks of 32)
MISTRAL_WINDOW = 200  # tokens: the tiny Mistral's window on every layer (not a multiple of the 32-token block)
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def default_dir(family: str = "llama") -> Path:
    """``$XDG_CACHE_HOME/kvplugins/demo-model-v1`` (``~/.cache`` when XDG_CACHE_HOME is unset); the Gemma-3's
    is ``demo-gemma3-v1`` beside it. Raises ValueError for another family."""
    if family not in FAMILY_DIRS:
        raise ValueError(f"model family {family!r}: use one of {sorted(FAMILY_DIRS)}")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvplugins" / FAMILY_DIRS[family]


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.train_from_iterator(corpus(), trainers.WordLevelTrainer(special_tokens=SPECIAL))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(path)


def _weights(path: Path, vocab_size: int, seed: int, family: str) -> None:
    import torch
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        initializer_range=0.08,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="float32",
    )
    if family == "gemma3":  # layers alternate sliding / full: vLLM makes one KV cache group of each
        # untied, wider weights: with Gemma's tied, scaled embeddings a random model repeats the last token
        common["initializer_range"] = 0.2
        cfg = tf.Gemma3TextConfig(
            **common,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=GEMMA3_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
            tie_word_embeddings=False,
        )
        cls = tf.Gemma3ForCausalLM
    elif family == "lfm2":  # conv, attention, conv, attention: one Mamba (ShortConv) and one full-attention group
        common["initializer_range"] = 0.2  # as for Gemma-3: small random weights repeat one token
        cfg = tf.Lfm2Config(
            **common, layer_types=["conv", "full_attention"] * 2, conv_L_cache=3, tie_word_embeddings=False
        )
        cls = tf.Lfm2ForCausalLM
    elif family == "qwen3next":  # linear (GDN), full, linear, full; vLLM-CPU's GDN kernel wants head dims of 128
        common["initializer_range"] = 0.2
        cfg = tf.Qwen3NextConfig(
            **common,
            head_dim=64,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            tie_word_embeddings=False,
        )
        cls = tf.Qwen3NextForCausalLM
    elif family == "granite4":  # Mamba2, attention, Mamba2, attention (no MoE experts: a shared MLP)
        common["initializer_range"] = 0.2
        cfg = tf.GraniteMoeHybridConfig(
            **common,
            layer_types=["mamba", "attention"] * 2,
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_chunk_size=32,
            mamba_expand=2,
            mamba_d_conv=4,
            num_local_experts=0,
            shared_intermediate_size=512,
            position_embedding_type="rope",
            tie_word_embeddings=False,
        )
        cls = tf.GraniteMoeHybridForCausalLM
    elif family == "llama-wide":  # `kvplugins demo`'s: wide enough that a prompt's prefill costs what it costs
        common.update(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            initializer_range=0.05,
        )
        cfg, cls = tf.LlamaConfig(**common, tie_word_embeddings=False), tf.LlamaForCausalLM
    elif family == "deepseek-v2":  # MLA on every layer, all MLPs dense (first_k_dense_replace = the layers)
        common.update(num_key_value_heads=4, initializer_range=0.1)
        cfg = tf.DeepseekV2Config(
            **common,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            first_k_dense_replace=4,
            n_shared_experts=1,
            tie_word_embeddings=False,
        )
        cls = tf.DeepseekV2ForCausalLM
    elif family == "mistral":  # every layer sliding: vLLM makes one KV cache group, a sliding-window one
        cfg = tf.MistralConfig(**common, sliding_window=MISTRAL_WINDOW, tie_word_embeddings=False)
        cls = tf.MistralForCausalLM
    else:
        cfg, cls = tf.LlamaConfig(**common, tie_word_embeddings=False), tf.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    if family == "lfm2":  # vLLM's Lfm2 reads the conv/block widths that LiquidAI's configs carry and HF's lacks
        conf = json.loads((path / "config.json").read_text())
        conf.update(conv_dim=conf["hidden_size"], block_dim=conf["hidden_size"], block_ff_dim=conf["intermediate_size"])
        (path / "config.json").write_text(json.dumps(conf, indent=2))


def ensure_model(path: str | os.PathLike | None = None, seed: int = 0, family: str = "llama") -> Path:
    """Return the model directory, building it first if absent (a few seconds). ``family``: "llama",
    "llama-wide" (the demo's), "gemma3", "lfm2", "qwen3next", "granite4", "mistral" or
    "deepseek-v2". Safe to race: the loser's build is discarded. Needs torch,
    transformers and tokenizers (installed with vLLM). Raises ValueError for another family."""
    final = Path(path) if path else default_dir(family)
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        _tokenizer(tmp)
        from transformers import PreTrainedTokenizerFast

        vocab = len(PreTrainedTokenizerFast.from_pretrained(tmp))
        _weights(tmp, vocab, seed, family)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
