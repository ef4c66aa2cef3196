"""One side of SGLang 0.5.23's ``--load-format remote_instance`` with the ``transfer_engine`` backend, class level,
on kvplugins through the ``mooncake.engine`` shim (site dir: argv[2]).

    python remote_instance_worker.py seed SITE
        builds the model with its weights, registers them with SGLang's ``register_memory_region_v1`` on a
        ``mooncake.engine.TransferEngine`` (as SGLang's RemoteInstanceWeightTransporter does on a seed), puts
        (session id, weight info) to SGLang's own ``EngineInfoBootstrapServer`` as the transporter does, and
        serves ``/get_remote_instance_transfer_engine_info?rank=`` as SGLang's HTTP server does (it proxies the
        bootstrap server; the real one needs a GPU engine: this stand-in forwards the same request). Prints its
        URL and the weights' digest, then waits for stdin to close.
    python remote_instance_worker.py client SITE SEED_URL
        builds the model with zeroed weights, registers them (SGLang's loader registers before it reads) and runs
        SGLang's ``RemoteInstanceModelLoader.load_model_from_remote_instance_by_transfer_engine``; prints whether
        it succeeded and the weights' digest.

The model: real tensors of the dtypes and shapes a decoder layer has (bf16 and fp32, 2-D and 1-D, ~6 MiB).
SGLang's ``register_memory_region`` picks its v2 (CUDA memory snapshot) whenever torch imports; v1 (one region
per parameter) is what runs on a CPU-only torch. SGLang imports triton at module level: sglang_cpu stands it in."""

from __future__ import annotations

import hashlib
import http.server
import json
import site
import socket
import sys
import threading
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
site.addsitedir(sys.argv[2])
import sglang_cpu  # noqa: E402

sglang_cpu.install()
import torch  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.entrypoints.engine_info_bootstrap_server import EngineInfoBootstrapServer  # noqa: E402
from sglang.srt.model_loader.loader import RemoteInstanceModelLoader  # noqa: E402
from sglang.srt.model_loader.remote_instance_weight_loader_utils import register_memory_region_v1  # noqa: E402

from mooncake.engine import TransferEngine  # noqa: E402


def model(seed: int | None) -> torch.nn.Module:
    torch.manual_seed(seed or 0)
    m = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(1024, 256).to(torch.bfloat16),
            "qkv": torch.nn.Linear(256, 768, bias=True).to(torch.bfloat16),
            "mlp": torch.nn.Linear(256, 2048, bias=False),
            "norm": torch.nn.LayerNorm(256),
        }
    )
    if seed is None:
        for p in m.parameters():
            p.data.zero_()
    return m


def digest(m: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in m.named_parameters():
        h.update(name.encode() + p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def engine() -> TransferEngine:
    te = TransferEngine()
    assert type(te).__module__ == "kvplugins.mooncake.te", type(te).__module__
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return te


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed() -> None:
    m, te = model(7), engine()
    info = register_memory_region_v1(m, te)
    boot = EngineInfoBootstrapServer("127.0.0.1", free_port())
    payload = {"tp_rank": 0, "transfer_engine_info": {"session_id": f"127.0.0.1:{te.get_rpc_port()}",
                                                      "weights_info_dict": info}}  # fmt: skip
    put = urllib.request.Request(
        f"http://127.0.0.1:{boot.port}/register_transfer_engine_info", json.dumps(payload).encode(), method="PUT",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    for _ in range(100):  # the bootstrap server's uvicorn thread starts listening shortly
        try:
            urllib.request.urlopen(put, timeout=5).read()
            break
        except OSError:
            threading.Event().wait(0.1)

    class Http(http.server.BaseHTTPRequestHandler):  # SGLang's HTTP server: forwards to the bootstrap server
        def do_GET(self):
            rank = self.path.partition("rank=")[2]
            with urllib.request.urlopen(f"http://127.0.0.1:{boot.port}/get_transfer_engine_info?rank={rank}") as r:
                body = r.read()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Http)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(json.dumps([f"http://127.0.0.1:{srv.server_port}", digest(m)]), flush=True)
    sys.stdin.read()
    srv.shutdown()
    boot.close()
    te.close()


def client(seed_url: str) -> None:
    m, te = model(None), engine()
    register_memory_region_v1(m, te)
    loader = RemoteInstanceModelLoader(LoadConfig(load_format="remote_instance"))
    ok = loader.load_model_from_remote_instance_by_transfer_engine(m, te, seed_url, 0)
    print(json.dumps([ok, digest(m)]), flush=True)
    te.close()


if __name__ == "__main__":
    seed() if sys.argv[1] == "seed" else client(sys.argv[3])
