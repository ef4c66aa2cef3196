"""An SGLang 0.5.23 engine worker's weight-update path on CPU, for tests/sglang/test_weight_update.py: SGLang's own
``LlamaForCausalLM`` (its fused qkv/gate_up parameters and weight loaders) built from the demo model, with SGLang's
``WeightUpdater`` (what its scheduler calls for ``update_weights_from_tensor``) and the runtime context and
process groups (gloo, world size 1) SGLang publishes before building a model. SGLang's server needs a GPU; this
is the same code below it.

    python weight_update_worker.py MODEL_DIR    prints the digest of the model's parameters, then answers:
      update <hex>      SGLang's update_weights_from_tensor([(SPEC, uint8 tensor of those bytes)], LOADER)
                        -> [success, message, digest]
      fresh <file>      digest of another SGLang model built and loaded from that safetensors file
SGLang imports triton at module level: sglang_cpu stands it in."""

from __future__ import annotations

import hashlib
import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_cpu  # noqa: E402

sglang_cpu.install()
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, publish  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from kvplugins.sglang_weight_update import LOADER, SPEC  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode() + p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    path = sys.argv[1]
    publish(ServerArgs(model_path=path, device="cpu", custom_weight_loader=[LOADER]), role="test",
            ranks=SpawnRanks(world_rank=0))  # fmt: skip
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")  # fmt: skip
    initialize_model_parallel(backend="gloo")
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.models.llama import LlamaForCausalLM

    config = AutoConfig.from_pretrained(path)

    def built(weights: str) -> torch.nn.Module:
        m = LlamaForCausalLM(config)
        m.load_weights(list(load_file(weights).items()))
        return m

    model = built(f"{path}/model.safetensors")
    updater = WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders=[LOADER],
        get_model=lambda: model, update_model_fields=None, recapture_cuda_graph=None, get_model_runner=None,
    )  # fmt: skip
    print(json.dumps(digest(model)), flush=True)
    for line in sys.stdin:
        cmd, arg = line.split()
        if cmd == "update":
            spec = torch.frombuffer(bytearray(bytes.fromhex(arg)), dtype=torch.uint8)
            ok, msg = updater.update_weights_from_tensor([(SPEC, spec)], load_format=LOADER)
            print(json.dumps([ok, msg, digest(model)]), flush=True)
        else:
            print(json.dumps(digest(built(arg))), flush=True)


if __name__ == "__main__":
    main()
