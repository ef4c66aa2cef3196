"""SGLang 0.5.23's own kt_ep_wrapper driven on CPU through the kt_kernel shim (see sglang_kt_case.py for the
stand-ins and why). Skipped, with the reason, when sglang is not installed."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.installed import installed
from kt_ref import ref_moe, random_experts, rel_err
from kvplugins.kt_expert_backend import deferral, native, shim, weights

E, H, I, K, NUM_GPU = 8, 128, 64, 2, 3


def _converted(root, experts):
    for layer in (0, 1):
        t = {}
        for e in range(E):
            for name, m in zip(weights.PROJS, experts):
                t[f"{e}.{name}.q"] = native.quantize("bf16", m[e])[0]
        weights.save_layer(root, layer, t)
    weights.write_meta(root, weights.Meta("bf16", 0, E, H, I, [0, 1]))


@pytest.mark.skipif(
    not installed("sglang"),
    reason="sglang 0.5.23 is not installed in this venv (ci/install-sglang.sh)",
)
def test_sglang_kt_ep_wrapper_runs_our_backend(tmp_path):
    experts = random_experts(E, H, I, seed=21)
    _converted(tmp_path, experts)
    shim.enable(tmp_path / "site")
    case = os.path.join(os.path.dirname(__file__), "sglang_kt_case.py")
    r = subprocess.run(
        [sys.executable, case, str(tmp_path / "site"), str(tmp_path), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1"},
    )  # mask_cpu_expert_ids eager: -30 s CPU
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["kt_kernel"] == "kvplugins.kt_expert_backend.wrapper" and res["available"]
    assert res["gpu_experts_created_0"] == NUM_GPU
    assert (res["deferred_0"], res["deferred_1"]) == (1, 0)  # SGLang's rule: the last layer defers nothing
    assert "stopped_at" not in res, res.get("stopped_at")
    skip = torch.zeros(E, dtype=torch.bool)
    skip[:NUM_GPU] = True
    l0, l1 = res["layers"]
    x0, ids0, wt0 = torch.tensor(l0["x"]), torch.tensor(l0["ids"]), torch.tensor(l0["wt"])
    now, later = deferral.split(ids0.long(), wt0, E, 1)
    assert rel_err(torch.tensor(l0["out"]), ref_moe(x0, now, wt0, *experts, skip=skip)) < 0.01
    x1, ids1, wt1 = torch.tensor(l1["x"]), torch.tensor(l1["ids"]), torch.tensor(l1["wt"])
    want1 = ref_moe(x1, ids1, wt1, *experts, skip=skip) + ref_moe(x0, later, wt0, *experts, skip=skip)
    assert rel_err(torch.tensor(l1["out"]), want1) < 0.01
    assert l0["dtype"] == "torch.bfloat16"
    # SGLang masked the CPU experts out of topk_ids in place after submit; our copy was taken before that
    assert all(i == -1 or i < NUM_GPU for row in l0["masked_ids_after"] for i in row)
