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
        assert len(ia) >= 1000 and ib[: len(ia)] == ia
        assert tok.unk_token_id not in ib


def test_report_flags_mismatch():
    run = {"tokens": [[1, 2]], "prompt_tokens": [1200], "ttft_ms": [10.0], "external_hit_tokens": 1184}
    cold = {**run, "ttft_ms": [400.0]}
    res = DemoResult(a={**run, "external_hit_tokens": 0}, b=run, c={**cold, "tokens": [[1, 3]]})
    assert not res.ok and "False" in report(res) and res.summary().startswith("FAIL:")
    assert DemoResult(a=run, b=run, c=cold).ok
    assert not DemoResult(a=run, b=run, c=run).ok  # no TTFT win: FAIL


def test_summary_line_names_reuse_identity_ttft_and_load_rate():
    warm = {
        "tokens": [[1, 2], [3, 4]],
        "prompt_tokens": [1200, 1700],
        "ttft_ms": [300.0, 320.0],
        "external_hit_tokens": 2880,
        "kvplugins": {"loaded_blocks": 90, "loaded_bytes": 90 * 32 * 32768, "load_seconds_sum": 0.05},
    }
    cold = {**warm, "ttft_ms": [5000.0, 6400.0], "external_hit_tokens": 0, "kvplugins": {}}
    line = DemoResult(a=cold, b=warm, c=cold).summary()
    assert line == (
        "PASS: 2,880 of 2,900 prompt tokens reused from the store; greedy tokens identical in 2 of 2 "
        "prompts; TTFT warm/cold 0.054 (310 vs 5,700 ms, median; goal < 0.5); KV 32 KiB per token; "
        "store load 1.89 GB/s"
    )
