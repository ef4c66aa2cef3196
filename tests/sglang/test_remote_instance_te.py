"""SGLang 0.5.23's ``--load-format remote_instance`` with the ``transfer_engine`` backend (a new instance reads its
weights from a running seed instance's memory) on kvplugins' Transfer Engine API, class level with real host
tensors in two processes (issue #36): SGLang's servers need a GPU. SGLang's own pieces run: the seed registers
its weights with ``register_memory_region_v1`` and publishes them to SGLang's ``EngineInfoBootstrapServer``; the
client's ``RemoteInstanceModelLoader.load_model_from_remote_instance_by_transfer_engine`` fetches the info and
reads every weight with one ``batch_transfer_sync_read``. Stand-in: the seed's HTTP endpoint that forwards to the
bootstrap server (remote_instance_worker.py). Run with host memory and with the weights as (emulated) device
memory, the path a GPU instance's weights take (staged through host memory on both sides)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.model_loader", reason="sglang not installed: bash ci/install-sglang.sh")

from kvplugins.mooncake import shim as mooncake_shim  # noqa: E402

WORKER = Path(__file__).with_name("remote_instance_worker.py")


@pytest.mark.parametrize("memory", ["host", "device"])
def test_a_new_instance_reads_its_weights_from_a_seed_through_sglangs_loader_on_ours(tmp_path, memory):
    mooncake_shim.SHIM.enable(tmp_path, force=True)
    env = {**os.environ, "KVPLUGINS_TRANSFER_DEVICE_EMULATION": "1" if memory == "device" else "0"}
    seed = subprocess.Popen(
        [sys.executable, str(WORKER), "seed", str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = seed.stdout.readline()  # type: ignore[union-attr]
        assert line, seed.stderr.read()[-3000:]  # type: ignore[union-attr]
        url, want = json.loads(line)
        got = subprocess.run(
            [sys.executable, str(WORKER), "client", str(tmp_path), url],
            capture_output=True, text=True, timeout=180, env=env,
        )  # fmt: skip
        assert got.returncode == 0, got.stderr[-3000:]
        ok, digest = json.loads(got.stdout.strip().splitlines()[-1])
        assert ok is True and digest == want  # every weight, byte for byte
        staged = "device memory is staged" in got.stderr
        assert staged == (memory == "device")
    finally:
        seed.stdin.close()  # type: ignore[union-attr]
        seed.wait(timeout=30)
