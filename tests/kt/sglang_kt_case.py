"""Drive SGLang 0.5.23's own kt_ep_wrapper (KTEPWrapperMethod) on CPU with the kt_kernel shim; run as a script:
    python sglang_kt_case.py SITE_DIR WEIGHT_DIR OUT_JSON
TEST ENV ONLY. Stand-ins, each for something that cannot exist on this machine and named so:
  - triton / torchvision modules (tests/sglang/sglang_cpu.py: GPU compiler; no CPU wheel for torch 2.13.0);
  - torch.cuda.synchronize / torch.cuda.current_stream (no GPU; SGLang calls them unconditionally);
  - the GPU half of the layer (``gpu_method``): returns zeros, i.e. the GPU experts' share is left out;
  - the EPLB expert-location metadata (built by a full model runner): the identity physical->logical map;
  - the MoeRunnerConfig (built by the model's FusedMoE layer): only ``activation="silu"`` is read here.
Everything else (KTConfig, create_weights with upstream's num_gpu_experts= call, the last-layer deferral rule,
process_weights_after_loading -> load_weights, apply -> submit/mask_cpu_expert_ids/sync) is SGLang's code."""

import json
import os
import site
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sglang"))
import sglang_cpu  # noqa: E402

sglang_cpu.install()
site.addsitedir(sys.argv[1])

import torch  # noqa: E402

E, H, I, K, NUM_GPU = 8, 128, 64, 2, 3


def main(weight_dir: str, out_json: str) -> None:
    import kt_kernel
    import sglang.srt.eplb.expert_location_dispatch as eld
    import sglang.srt.layers.moe.kt_ep_wrapper as kw
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput, StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.runtime_context import get_parallel

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: types.SimpleNamespace(cuda_stream=0)
    eld.get_global_expert_location_metadata = lambda: types.SimpleNamespace(
        physical_to_logical_map_cpu=torch.arange(E)[None].repeat(2, 1)
    )
    get_parallel().override_permanently(tp_rank=0)

    class GpuHalf:
        def create_weights(self, **kwargs):
            self.num_experts = kwargs["num_experts"]

        def create_moe_runner(self, layer, runner_config):
            self.runner_config = runner_config

        def apply(self, layer, dispatch_output):
            return StandardCombineInput(hidden_states=torch.zeros_like(dispatch_output.hidden_states))

    res = {"kt_kernel": kt_kernel.KTMoEWrapper.__module__, "available": kw.KTRANSFORMERS_AVAILABLE}
    outs = []
    for layer_idx in (0, 1):
        cfg = kw.KTConfig(
            layer_idx=layer_idx,
            num_gpu_experts=NUM_GPU,
            cpuinfer_threads=2,
            threadpool_count=1,
            weight_path=weight_dir,
            chunked_prefill_size=64,
            max_deferred_experts_per_token=1,
            method="BF16",
            num_layers=2,
        )
        method = kw.KTEPWrapperMethod(GpuHalf(), cfg)
        layer = types.SimpleNamespace(top_k=K, intermediate_size_per_partition=I, moe_tp_size=1)
        method.create_weights(
            layer, num_experts=E, hidden_size=H, intermediate_size_per_partition=I, params_dtype=torch.bfloat16
        )
        method.process_weights_after_loading(layer)
        method.create_moe_runner(layer, types.SimpleNamespace(activation="silu", num_local_experts=E))
        res[f"gpu_experts_created_{layer_idx}"] = method.gpu_method.num_experts
        res[f"deferred_{layer_idx}"] = method.wrapper.max_deferred_experts_per_token
        g = torch.Generator().manual_seed(layer_idx)
        x = torch.randn(5, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)]).to(torch.int32)
        wt = torch.rand(5, K, generator=g)
        topk = StandardTopKOutput(topk_weights=wt, topk_ids=ids.clone(), router_logits=torch.zeros(5, E))
        try:
            out = method.apply(
                layer, StandardDispatchOutput(hidden_states=x, hidden_states_scale=None, topk_output=topk)
            ).hidden_states
        except Exception as e:  # report where upstream stops on CPU
            res["stopped_at"] = f"apply: {type(e).__name__}: {e}"[:300]
            break
        outs.append(
            {
                "x": x.float().tolist(),
                "ids": ids.tolist(),
                "wt": wt.tolist(),
                "out": out.float().tolist(),
                "masked_ids_after": topk.topk_ids.tolist(),
                "dtype": str(out.dtype),
            }
        )
    res["layers"] = outs
    with open(out_json, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[2], sys.argv[3])
