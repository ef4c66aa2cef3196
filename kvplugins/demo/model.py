"""A tiny random-weight Llama (real LlamaForCausalLM architecture) and its tokenizer, built locally once.

No hub access: the tokenizer is a word-level tokenizer trained on the demo's conversation text and the
weights are random with a fixed seed, so every build is identical. float32 keeps greedy decoding stable
(argmax margins far above rounding noise). Cached under ``$XDG_CACHE_HOME/kvplugins/demo-model-v1``
(default ``~/.cache``); the directory appears atomically (built in a temp dir, then renamed).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

MODEL_DIR_NAME = "demo-model-v1"
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/kvplugins/demo-model-v1`` (``~/.cache`` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvplugins" / MODEL_DIR_NAME


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvplugins.demo.conversation import corpus

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.train_from_iterator(corpus(), trainers.WordLevelTrainer(special_tokens=SPECIAL))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)


def _weights(path: Path, vocab_size: int, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                      tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)


def ensure_model(path: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Return the model directory, building it first if absent (a few seconds). Safe to race: the loser's
    build is discarded. Needs torch, transformers and tokenizers (installed with vLLM)."""
    final = Path(path) if path else default_dir()
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        _tokenizer(tmp)
        from transformers import PreTrainedTokenizerFast
        vocab = len(PreTrainedTokenizerFast.from_pretrained(tmp))
        _weights(tmp, vocab, seed)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
