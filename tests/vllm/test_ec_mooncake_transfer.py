"""vLLM 0.32's encoder-cache Mooncake transfer class (``MooncakeTransfer``: the data plane ECMooncakeConnector
pushes encoder outputs with, from the encoder instance into the language model instance's memory) on kvplugins'
Transfer Engine API, class level with real tensors in two processes (issue #36): the connector end to end needs
a multimodal model, which this project's tests do not download. The producer registers sibling views of one
storage as transient sources, writes them into the consumer's registered cache in another order and releases
them; the consumer's bytes equal them. Run with host memory and with both sides' tensors as (emulated) device
memory, as on GPU instances."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.distributed.ec_transfer.ec_connector.mooncake.transfer", reason="vllm not installed")

from kvplugins.mooncake import shim as mooncake_shim  # noqa: E402

WORKER = Path(__file__).with_name("ec_mooncake_worker.py")


@pytest.mark.parametrize("memory", ["host", "device"])
def test_encoder_outputs_pushed_through_vllms_ec_mooncake_transfer_on_ours(tmp_path, memory):
    mooncake_shim.SHIM.enable(tmp_path, force=True)
    env = {**os.environ, "KVPLUGINS_TRANSFER_DEVICE_EMULATION": "1" if memory == "device" else "0"}
    consumer = subprocess.Popen(
        [sys.executable, str(WORKER), "consumer", str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = consumer.stdout.readline()  # type: ignore[union-attr]
        assert line, consumer.stderr.read()[-3000:]  # type: ignore[union-attr]
        session, addr = json.loads(line)
        pro = subprocess.run(
            [sys.executable, str(WORKER), "producer", str(tmp_path), session, str(addr)],
            capture_output=True, text=True, timeout=180, env=env,
        )  # fmt: skip
        assert pro.returncode == 0, pro.stderr[-3000:]
        released, digest = json.loads(pro.stdout.strip().splitlines()[-1])
        assert released == [True, True]
        assert ("device memory is staged" in pro.stderr) == (memory == "device")
        consumer.stdin.write(f"check {digest}\n")  # type: ignore[union-attr]
        consumer.stdin.flush()  # type: ignore[union-attr]
        assert json.loads(consumer.stdout.readline()) is True  # type: ignore[union-attr]
    finally:
        consumer.stdin.close()  # type: ignore[union-attr]
        assert consumer.wait(timeout=30) == 0
