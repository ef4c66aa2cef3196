"""The demo's inputs: a real Llama model dir, and next-turn prompts that extend the first-turn prompts by
>= 1,000-token shared prefixes (what the store must serve). No engine started here."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplugins.demo.run import DemoConfig, DemoResult, prompts, report

pytest.importorskip("transformers")
pytestmark = pytest.mark.vllm


def test_model_is_a_llama_with_local_tokenizer(model):
    cfg = json.loads((Path(model) / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and 4 <= cfg["num_hidden_layers"] <= 8
    assert (Path(model) / "tokenizer.json").exists()


def test_next_turn_prompts_share_long_prefixes(model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    a, b = prompts(DemoConfig(conversations=2))
    assert a != b and len(set(a)) == 2
    for pa, pb in zip(a, b):
        ia, ib = tok(pa).input_ids, tok(pb).input_ids
        assert len(ia) >= 1000 and ib[:len(ia)] == ia
        assert tok.unk_token_id not in ib


def test_report_flags_mismatch():
    run = {"tokens": [[1, 2]], "prompt_tokens": [1200], "ttft_ms": [10.0], "external_hit_tokens": 1184}
    res = DemoResult(a={**run, "external_hit_tokens": 0}, b=run, c={**run, "tokens": [[1, 3]]})
    assert not res.ok and "False" in report(res)
    assert DemoResult(a=run, b=run, c=run).ok
