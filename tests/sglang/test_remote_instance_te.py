"""SGLang 0.5.23's ``--load-format remote_instance`` with the ``transfer_engine`` backend (a new instance reads its
weights from a running seed instance's memory) on kvplugins' Transfer Engine API, class level with real host
tensors in two processes (issue #36): SGLang's servers need a GPU. SGLang's own pieces run: the seed registers
its weights with ``register_memory_region_v1`` and publishes them to SGLang's ``EngineInfoBootstrapServer``; the
client's ``RemoteInstanceModelLoader.load_model_from_remote_instance_by_transfer_engine`` fetches the info and
reads every weight with one ``batch_transfer_sync_read``. Stand-in: the seed's HTTP endpoint that forwards to the
bootstrap server (remote_instance_worker.py). Run with host memory and with the weights as (emulated) device
memory, the path a GPU instance's weights take (staged through host memory on both sides)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.te_workers import run, served, shimmed_env

pytest.importorskip("sglang.srt.model_loader", reason="sglang not installed: bash ci/install-sglang.sh")

WORKER = Path(__file__).with_name("remote_instance_worker.py")


@pytest.mark.parametrize("memory", ["host", "device"])
def test_a_new_instance_reads_its_weights_from_a_seed_through_sglangs_loader_on_ours(tmp_path, memory):
    env = shimmed_env(tmp_path, memory)
    with served(WORKER, "seed", str(tmp_path), env=env) as ((url, want), _):
        (ok, digest), err = run(WORKER, "client", str(tmp_path), url, env=env)
        assert ok is True and digest == want  # every weight, byte for byte
        assert ("device memory is staged" in err) == (memory == "device")
