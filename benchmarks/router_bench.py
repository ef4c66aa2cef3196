"""Real engines behind ``kvplugins router`` (issue #37): each routing's TTFT p50/p99, SLO attainment, goodput,
rejections and cache hits on the FAST'25 conversation trace, scaled down to CPU engines; the Conductor's predicted
TTFT against the measured one.

Fleet: ``--instances`` vLLM-CPU OpenAI servers, random weights shaped like Qwen2.5-0.5B (vllm_ttft.build_model;
24 layers, bf16), each bound to its own CPU, our connector on one store (a master with ``--events-port 0`` and one
node) and vLLM's KV events on. Workload: ``--requests`` consecutive requests of the trace from ``--start``; each
512-token block (hash id) becomes ``--block-scale`` tokens (its content a function of the hash id, so shared hash
ids are shared prefixes, as in the trace), the input length scaled the same way; ``--out`` output tokens each;
arrivals at the trace's times divided by each of ``--speeds``. Every routing runs on the same engines with its own token
contents (a salt per run), so no run hits another's pages; each of ``--rounds`` starts the routings' order at
the next one (a run's place in the sequence should not decide it: the engines' caches and the store fill up).

Routings: round_robin, prefix_aware (the router's baselines), conductor, conductor with early rejection
(``+slo``: ``--slo-ms``), with its predictions following what it measures (``+measured``: --measure-rates) and
with a bound on the imbalance of requests in flight (``+bounded``: --max-imbalance). The router runs with --kv-events, --store-master and --engine-hash vllm:sha256; its prefill rate
is measured first (a cold ``--calibrate``-token prompt on each engine), pool loads are charged ``--load-gbps``.
Per run: TTFT p50/p99 of the served requests, SLO attainment (served within ``--slo-ms`` / all requests), goodput
(requests within the SLO per second, first arrival to last answer), rejections, errors, the engines' local prefix
hits and pool loads (tokens, from their /metrics), and the median |measured - predicted| TTFT.

    .venv/bin/python benchmarks/router_bench.py [--trace F] [--instances 2] [--requests 120] [--speeds 1,2]
        [--slo-ms 4000] [--rounds 1] [--json F]

A trace with more reuse per minute than the FAST'25 one's first minutes (~4% of blocks repeat within 120
requests there): ``kvplugins replay --synth --synth-requests 200 --synth-out F ...`` writes replay's synthetic
sessions (shared system prompts, documents, multi-turn conversations) in the same JSONL form.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from machine import cpu_model, free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from kvplugins.demo.engine import private_tmp, remove_private_tmp, stop_group  # noqa: E402

CLI = [sys.executable, "-c", "import sys; from kvplugins.cli import main; sys.exit(main(sys.argv[1:]))"]
BLOCK = 32  # the engines' block size (tokens)
ROUTINGS = ("round_robin", "prefix_aware", "conductor", "conductor+slo", "conductor+slo+measured")


def spawn(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})  # fmt: skip


def wait_file(path: Path, proc: subprocess.Popen, what: str, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start (see {path.parent})")
        time.sleep(0.2)
    return path.read_text().strip()


def http(url: str, body: dict | None = None, timeout: float = 600) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


class Fleet:
    """The store and the engines (started in __init__, stopped by close)."""

    def __init__(self, model: Path, n: int, logs: Path):
        self.procs: list[subprocess.Popen] = []
        self.tmps: list[str] = []  # each engine's private_tmp
        port_file = logs / "master.port"
        self.procs.append(spawn(CLI + ["master", "--port", "0", "--port-file", str(port_file), "--events-port", "0"],
                                logs / "master.log"))  # fmt: skip
        self.master = wait_file(port_file, self.procs[-1], "the master")
        ready = logs / "node.ready"
        self.procs.append(spawn(CLI + ["store", "--master", self.master, "--segment-size", "4GiB", "--ready-file",
                                       str(ready)], logs / "node.log"))  # fmt: skip
        wait_file(ready, self.procs[-1], "the store node")
        cpus = sorted(os.sched_getaffinity(0))
        self.urls, self.events = [], []
        ktc = {"kv_connector": "KVPluginsConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {"store": {"master": self.master}}}  # fmt: skip
        for i in range(n):
            port, ev = free_port(), free_port()
            kve = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}"}
            args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
                    "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--block-size", str(BLOCK),
                    "--max-model-len", "4096", "--enforce-eager", "--max-num-seqs", "8", "--seed", "0",
                    "--kv-transfer-config", json.dumps(ktc), "--kv-events-config", json.dumps(kve)]  # fmt: skip
            self.tmps.append(tempfile.mkdtemp(prefix="kvp-vllm-"))
            env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": str(cpus[i % len(cpus)]),
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **private_tmp(self.tmps[-1])}  # fmt: skip
            self.procs.append(spawn(args, logs / f"engine{i}.log", env))
            self.urls.append(f"http://127.0.0.1:{port}")
            self.events.append(f"tcp://127.0.0.1:{ev}")
        deadline = time.monotonic() + 600
        for u in self.urls:
            while http(u + "/health", timeout=5)[0] != 200:
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise SystemExit(f"an engine did not start (see {logs})")
                time.sleep(1)

    def metrics(self) -> dict[str, float]:
        """Summed over the engines: local prefix-cache hit tokens and pool-loaded blocks."""
        out = {"local_hit_tokens": 0.0, "pool_blocks": 0.0}
        for u in self.urls:
            text = http(u + "/metrics")[1].decode(errors="replace")
            for name, key in (("vllm:prefix_cache_hits_total", "local_hit_tokens"),
                              ("vllm:kvplugins_loaded_blocks_total", "pool_blocks")):  # fmt: skip
                out[key] += sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} ([\d.e+]+)$", text, re.M))
        return out

    def close(self) -> None:
        for p in reversed(self.procs):
            stop_group(p)
        for t in self.tmps:
            remove_private_tmp(t)


def workload(trace: Path, start: int, n: int, scale: int, salt: int, words: list[str] | None) -> list[tuple]:
    """(arrival s from the first, prompt) of trace lines [start, start + n): token ids, or with ``words`` text
    (each block ``scale`` words of the tokenizer's vocabulary, whole blocks)."""
    rows = [json.loads(line) for line in trace.read_text().splitlines()[start : start + n]]
    t0 = rows[0]["timestamp"]
    out = []
    for r in rows:
        tokens = [t for h in r["hash_ids"] for t in block_tokens(h, scale, salt)]
        keep = max(1, min(len(tokens), round(r["input_length"] * scale / 512)))
        prompt: list[int] | str = tokens[:keep]
        if words is not None:
            blocks = -(-keep // scale)
            prompt = " ".join(words[t % len(words)] for t in tokens[: blocks * scale])
        out.append(((r["timestamp"] - t0) / 1000, prompt))
    return out


def vocabulary(model: Path) -> list[str]:
    """The tokenizer's plain-word tokens (text prompts: SGLang's router takes text only)."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(model))
    return sorted({w for w in tok.get_vocab() if w.isalpha() and w.islower()})


def block_tokens(h: int, scale: int, salt: int) -> list[int]:
    """The tokens of trace block ``h`` in run ``salt`` (ids 4..163: the demo tokenizer has 170)."""
    rng = random.Random(h * 1_000_003 + salt)
    return [rng.randrange(4, 164) for _ in range(scale)]


async def drive(url: str, model: str, reqs, speed: float, out_tokens: int) -> list[dict]:
    import aiohttp

    async def one(session, at: float, tokens: list[int] | str) -> dict:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - begin)))
        sent = time.monotonic()
        body = {"model": model, "prompt": tokens, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        rec = {"sent": sent - begin, "status": 0, "ttft": None, "done": None, "predicted": None}
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                rec["status"] = resp.status
                m = re.search(r"ttft_ms=([\d.]+)", resp.headers.get("x-kvplugins-prediction", ""))
                rec["predicted"] = float(m.group(1)) / 1000 if m else None
                async for _ in resp.content.iter_any():
                    if rec["ttft"] is None:
                        rec["ttft"] = time.monotonic() - sent
                rec["done"] = time.monotonic() - begin
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        return rec

    begin = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*(one(session, at / speed, toks) for at, toks in reqs))


def summarize(recs: list[dict], slo_s: float, before: dict, after: dict) -> dict:
    served = [r for r in recs if r["status"] == 200 and r["ttft"] is not None]
    ttfts = sorted(r["ttft"] for r in served)
    within = sum(1 for t in ttfts if t <= slo_s)
    span = max((r["done"] for r in served), default=0.0) - min((r["sent"] for r in recs), default=0.0)
    errors = [r["predicted"] - r["ttft"] for r in served if r["predicted"] is not None]

    def pct(q: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000 if ttfts else float("nan")

    return {
        "requests": len(recs),
        "served": len(served),
        "rejected": sum(1 for r in recs if r["status"] == 429),
        "errors": sum(1 for r in recs if r["status"] not in (200, 429)),
        "ttft_p50_ms": round(pct(0.5), 1),
        "ttft_p99_ms": round(pct(0.99), 1),
        "slo_attainment": round(within / len(recs), 3),
        "admitted_within_slo": round(within / len(served), 3) if served else 0.0,
        "goodput_rps": round(within / span, 3) if span > 0 else 0.0,
        "local_hit_tokens": int(after["local_hit_tokens"] - before["local_hit_tokens"]),
        "pool_hit_tokens": int((after["pool_blocks"] - before["pool_blocks"]) * BLOCK),
        "prediction_abs_error_ms": round(median(abs(e) for e in errors) * 1000, 1) if errors else None,
    }


def calibrate(fleet: Fleet, model: str, n: int) -> float:
    """Prefill tokens/s of one engine: a cold n-token prompt, one output token, on each; the median."""
    rates = []
    for i, u in enumerate(fleet.urls):
        prompt = [t for h in range(n // 64 + 1) for t in block_tokens(10_000_000 + i * 1000 + h, 64, 99)][:n]
        http(u + "/v1/completions", {"model": model, "prompt": prompt[:64], "max_tokens": 1})  # warm-up
        t0 = time.monotonic()
        status, _ = http(u + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})
        if status != 200:
            raise SystemExit(f"calibration request to {u} answered {status}")
        rates.append(n / (time.monotonic() - t0))
    return median(rates)


def our_router(fleet: Fleet, routing: str, args, rate: float, block_bytes: int, logs: Path, salt: int):
    """``kvplugins router`` with ``routing`` (base policy + options): (process, URL)."""
    parts = routing.split("+")
    extra = ["--slo-ttft-ms", str(args.slo_ms)] if "slo" in parts else []
    extra += ["--measure-rates"] if "measured" in parts else []
    extra += ["--max-imbalance", str(args.max_imbalance)] if "bounded" in parts else []
    port_file = logs / f"router{salt}.port"
    router = spawn(CLI + ["router", "--instances", ",".join(fleet.urls), "--kv-events", ",".join(fleet.events),
                          "--store-master", fleet.master, "--engine-hash", "vllm:sha256", "--routing", parts[0],
                          "--block-tokens", str(BLOCK), "--prefill-tok-s", f"{rate:.0f}", "--load-gbps",
                          str(args.load_gbps), "--block-bytes", str(block_bytes), "--port-file", str(port_file),
                          *extra], logs / f"router{salt}.log")  # fmt: skip
    return router, f"http://127.0.0.1:{wait_file(port_file, router, 'the router')}"


def sglang_router(fleet: Fleet, policy: str, log: Path):
    """SGLang's router (benchmarks/install_sglang_router.sh) with ``policy`` over the engines: (process, URL)."""
    dest = ROOT / ".bench" / "sglang-router"
    if not dest.exists():
        raise SystemExit("SGLang's router is not installed: bash benchmarks/install_sglang_router.sh")
    port = free_port()
    router = spawn([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                    "--worker-urls", *fleet.urls, "--policy", policy], log, {"PYTHONPATH": str(dest)})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while http(url + "/health", timeout=5)[0] != 200:
        if router.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"SGLang's router did not start (see {log})")
        time.sleep(0.5)
    return router, url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--block-scale", type=int, default=64, help="tokens per 512-token trace block")
    ap.add_argument("--out", type=int, default=4, help="output tokens per request")
    ap.add_argument("--speeds", default="1", help="loads: arrivals this many times faster than the trace's (list)")
    ap.add_argument("--slo-ms", type=float, default=4000.0)
    ap.add_argument("--load-gbps", type=float, default=2.0, help="the pool's load rate the router is told")
    ap.add_argument("--calibrate", type=int, default=1024)
    ap.add_argument("--routings", default=",".join(ROUTINGS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-imbalance", type=int, default=4, help="the bound of the +bounded routings")
    ap.add_argument("--text", action="store_true", help="text prompts (needed by SGLang's router) instead of token ids")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from vllm_ttft import MODEL_DIRS, build_model

    model = build_model(Path.home() / ".cache" / "kvplugins" / MODEL_DIRS["qwen2"])
    logs = Path(tempfile.mkdtemp(prefix="kvp-router-bench-"))
    fleet = Fleet(model, args.instances, logs)
    rows = []
    try:
        rate = calibrate(fleet, str(model), args.calibrate)
        # bf16 K and V of 24 layers x 2 KV heads x 64 per token
        block_bytes = 24 * 2 * 2 * 64 * 2 * BLOCK
        print(f"# {cpu_model()}; {args.instances} engines; prefill {rate:.0f} tokens/s each (calibrated)", flush=True)
        salt = 0
        names = args.routings.split(",")
        words = vocabulary(model) if args.text else None
        for rnd, speed in [(r, float(v)) for r in range(args.rounds) for v in args.speeds.split(",")]:
            for routing in names[rnd % len(names) :] + names[: rnd % len(names)]:  # each round starts elsewhere
                salt += 1
                reqs = workload(Path(args.trace), args.start, args.requests, args.block_scale, salt, words)
                if routing.startswith("sglang_"):
                    router, url = sglang_router(fleet, routing.removeprefix("sglang_"), logs / f"router{salt}.log")
                else:
                    router, url = our_router(fleet, routing, args, rate, block_bytes, logs, salt)
                time.sleep(1.0)  # the router's event subscriptions join
                before = fleet.metrics()
                recs = asyncio.run(drive(url, str(model), reqs, speed, args.out))
                time.sleep(2.0)  # the engines' last stats reach /metrics
                row = {
                    "round": rnd,
                    "speed": speed,
                    "routing": routing,
                    **summarize(recs, args.slo_ms / 1000, before, fleet.metrics()),
                }
                os.killpg(router.pid, signal.SIGTERM)
                router.wait(30)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        fleet.close()
    meta = {"cpu": cpu_model(), "instances": args.instances, "requests": args.requests, "speeds": args.speeds,
            "slo_ms": args.slo_ms, "prefill_tok_s": rate, "block_scale": args.block_scale, "logs": str(logs)}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
