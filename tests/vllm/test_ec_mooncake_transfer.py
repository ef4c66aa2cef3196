"""vLLM 0.32's encoder-cache Mooncake transfer class (``MooncakeTransfer``: the data plane ECMooncakeConnector
pushes encoder outputs with, from the encoder instance into the language model instance's memory) on kvplugins'
Transfer Engine API, class level with real tensors in two processes (issue #36): the connector end to end needs
a multimodal model, which this project's tests do not download. The producer registers sibling views of one
storage as transient sources, writes them into the consumer's registered cache in another order and releases
them; the consumer's bytes equal them. Run with host memory and with both sides' tensors as (emulated) device
memory, as on GPU instances."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.te_workers import ask, run, served, shimmed_env

pytest.importorskip("vllm.distributed.ec_transfer.ec_connector.mooncake.transfer", reason="vllm not installed")

WORKER = Path(__file__).with_name("ec_mooncake_worker.py")


@pytest.mark.parametrize("memory", ["host", "device"])
def test_encoder_outputs_pushed_through_vllms_ec_mooncake_transfer_on_ours(tmp_path, memory):
    env = shimmed_env(tmp_path, memory)
    with served(WORKER, "consumer", str(tmp_path), env=env) as ((session, addr), consumer):
        (released, digest), err = run(WORKER, "producer", str(tmp_path), session, str(addr), env=env)
        assert released == [True, True]
        assert ("device memory is staged" in err) == (memory == "device")
        assert ask(consumer, f"check {digest}") is True
