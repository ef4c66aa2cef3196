"""RL weight updates into SGLang over kvplugins.p2p (kvplugins/sglang_weight_update, issue #36), class level on CPU:
SGLang's own WeightUpdater.update_weights_from_tensor with our custom loader, on SGLang's own LlamaForCausalLM
(weight_update_worker.py: the code below SGLang's server, which needs a GPU), in another process than the trainer's
Publisher, over a real etcd catalog. After a round the worker's parameters equal those of a fresh SGLang model
loaded from the new checkpoint; a round the worker cannot pull leaves its weights as they were, SGLang still
answers success, and the Publisher's check raises."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.etcd import etcd_server
from helpers.te_workers import ask, served

pytest.importorskip("sglang.srt.model_executor", reason="sglang not installed: bash ci/install-sglang.sh")
from safetensors.torch import load_file, save_file  # noqa: E402

from kvplugins.demo.model import ensure_model  # noqa: E402
from kvplugins.errors import TransferFailed  # noqa: E402
from kvplugins.sglang_weight_update import Publisher  # noqa: E402

WORKER = Path(__file__).with_name("weight_update_worker.py")


def test_a_round_pulled_peer_to_peer_loads_through_sglangs_weight_updater(tmp_path, monkeypatch):
    model = ensure_model()
    new = {
        n: (t * 0.5 + 0.01 * i).contiguous() for i, (n, t) in enumerate(load_file(model / "model.safetensors").items())
    }
    save_file(new, tmp_path / "new.safetensors")
    monkeypatch.setenv("KVPLUGINS_P2P_HOST", "127.0.0.1")
    with etcd_server() as etcd, served(WORKER, str(model), env=dict(os.environ)) as (before, worker):
        pub = Publisher(etcd.endpoint)
        try:
            with pub.round(new.items(), workers=1) as named_tensors:
                ok, _, after = ask(worker, "update " + bytes(named_tensors[0][1].numpy()).hex())
            assert ok is True and after != before
            assert after == ask(worker, f"fresh {tmp_path / 'new.safetensors'}")  # SGLang's own loading of it
            with pytest.raises(TransferFailed, match="0 of 1 engine workers"):
                with pub.round(new.items(), workers=1) as named_tensors:
                    spec = bytes(named_tensors[0][1].numpy()).replace(b"/r2", b"/r9")  # a round nobody has
                    ok, _, kept = ask(worker, "update " + spec.hex())
            assert ok is True and kept == after  # SGLang answers success; the model kept its weights
            assert [p.name for p in pub.store.list()] == [pub.published]  # the failed round is gone
        finally:
            pub.close()
