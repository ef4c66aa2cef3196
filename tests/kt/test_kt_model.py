"""A tiny random HF Qwen3-MoE (transformers, no hub): convert its checkpoint with `kvplugins kt convert`, drive
every MoE block's experts through KTMoEWrapper.load_weights, and generate the same greedy tokens as HF in bf16."""

import json

import pytest
import torch

from kvplugins.cli import main as cli_main
from kvplugins.errors import ConfigError
from kvplugins.kt_expert_backend import KTMoEWrapper, weights

transformers = pytest.importorskip("transformers")

E, H, I, K, LAYERS = 8, 128, 64, 2, 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=H,
        intermediate_size=128,
        moe_intermediate_size=I,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=E,
        num_experts_per_tok=K,
        decoder_sparse_step=1,
        max_position_embeddings=128,
        initializer_range=0.3,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def _convert(tiny_path, out, method):
    rc = cli_main(
        [
            "kt",
            "convert",
            "--input",
            str(tiny_path),
            "--output",
            str(out),
            "--method",
            method,
            "--group",
            "64",
            "--no-progress",
        ]
    )
    assert rc == 0
    return weights.read_meta(out)


def _attach(model, weight_path, method):
    """Route every MoE block's experts through one KTMoEWrapper per layer (load_weights from the converted dir).
    Returns a per-layer call counter."""
    calls = [0] * LAYERS

    def run(w, idx, x, ids, wt):
        calls[idx] += 1
        return w.forward(x, ids, wt, None)

    for idx, layer in enumerate(model.model.layers):
        w = KTMoEWrapper(
            layer_idx=idx,
            num_experts=E,
            num_experts_per_tok=K,
            hidden_size=H,
            moe_intermediate_size=I,
            num_gpu_experts=0,
            cpuinfer_threads=2,
            threadpool_count=1,
            weight_path=str(weight_path),
            chunked_prefill_size=256,
            method=method,
            max_deferred_experts_per_token=0,
        )
        w.load_weights(torch.arange(E))
        layer.mlp.experts.forward = lambda x, ids, wt, _w=w, _i=idx: run(_w, _i, x, ids, wt)
    return calls


def _greedy(model, n=12):
    prompt = torch.tensor([[1, 5, 9, 17, 33, 2, 7]])
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)[0].tolist()


def test_convert_writes_every_layer(tiny, tmp_path):
    meta = _convert(tiny[1], tmp_path / "int8", "int8")
    assert (meta.format, meta.num_experts, meta.hidden_size, meta.moe_intermediate_size) == ("int8", E, H, I)
    assert meta.layers == list(range(LAYERS))
    assert json.loads((tmp_path / "int8" / weights.META).read_text())["version"] == 1
    q, s = weights.LayerReader(tmp_path / "int8", 1).get(E - 1, "down")
    assert q.shape == (H, I) and s.shape == (H, 1)


def test_greedy_tokens_match_hf_bf16(tiny, tmp_path):
    model, path = tiny
    want = _greedy(model)
    _convert(path, tmp_path / "bf16", "bf16")
    import copy

    ours = copy.deepcopy(model)
    calls = _attach(ours, tmp_path / "bf16", "BF16")
    assert _greedy(ours) == want
    assert calls == [12, 12]  # prefill + 11 decode steps per layer, all through the kvplugins kernels


def test_load_weights_refuses_mismatched_method(tiny, tmp_path):
    _convert(tiny[1], tmp_path / "int4", "int4")
    w = KTMoEWrapper(0, E, K, H, I, None, 1, 1, str(tmp_path / "int4"), 64, method="AMXINT8")
    with pytest.raises(ConfigError, match="re-run `kvplugins kt convert`"):
        w.load_weights(torch.arange(E))
    w4 = KTMoEWrapper(0, E, K, H, I, None, 1, 1, str(tmp_path / "int4"), 64, method="AMXINT4")
    w4.load_weights(torch.arange(E))
    assert w4.layer.group == 64 and all(w4.layer.loaded(e) for e in range(E))
