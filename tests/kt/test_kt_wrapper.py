"""KTMoEWrapper: both constructor APIs, GPU-expert skipping, output dtype/device, kt method names, deferral
semantics (sglang-kt fork), input copying, and an idle pool that sleeps."""

import inspect
import resource
import time

import pytest
import torch

from kt_ref import ref_moe, random_experts, rel_err, routing
from kvplugins.errors import ConfigError
from kvplugins.kt_expert_backend import KTMoEWrapper, deferral, methods

E, H, I, K = 8, 256, 128, 4
# kt-kernel 0.7.2 KTMoEWrapper.__new__ parameters (kt_kernel/experts.py), all of which we must accept
KT_072_PARAMS = [
    "layer_idx",
    "num_experts",
    "num_experts_per_tok",
    "hidden_size",
    "moe_intermediate_size",
    "gpu_experts_mask",
    "cpuinfer_threads",
    "threadpool_count",
    "weight_path",
    "chunked_prefill_size",
    "cpu_save",
    "max_deferred_experts_per_token",
    "method",
    "numa_nodes",
    "mode",
    "num_gpu_experts",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "max_cache_depth",
    "group_size",
    "zero_point",
    "full_weight_grad",
    "swiglu_limit",
    "swiglu_alpha",
]


@pytest.fixture(scope="module")
def experts():
    return random_experts(E, H, I, seed=11)


def kt072(layer_idx=0, mask=None, deferred=None, method="BF16"):
    """kt-kernel 0.7.2's positional/keyword call (as in its docstring)."""
    return KTMoEWrapper(
        layer_idx,
        E,
        K,
        H,
        I,
        mask,
        2,
        1,
        "",
        512,
        cpu_save=False,
        max_deferred_experts_per_token=deferred,
        method=method,
        numa_nodes=None,
    )


def sglang_0523(layer_idx=0, num_gpu=0, deferred=0, method="BF16"):
    """The exact keyword call of sglang 0.5.23 kt_ep_wrapper.KTEPWrapperMethod.create_weights."""
    return KTMoEWrapper(
        layer_idx=layer_idx,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        num_gpu_experts=num_gpu,
        cpuinfer_threads=2,
        threadpool_count=1,
        weight_path="",
        chunked_prefill_size=512,
        method=method,
        max_deferred_experts_per_token=deferred,
    )


def test_signature_accepts_every_kt_072_parameter():
    sig = inspect.signature(KTMoEWrapper.__init__)
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    named = set(sig.parameters)
    assert has_var_kw and {"gpu_experts_mask", "num_gpu_experts", "numa_nodes", "cpu_save"} <= named
    w = KTMoEWrapper(
        0,
        E,
        K,
        H,
        I,
        None,
        1,
        1,
        "",
        64,
        lora_rank=16,
        lora_alpha=32.0,
        lora_dropout=0.0,
        max_cache_depth=1,
        group_size=128,
        zero_point=True,
        full_weight_grad=False,
        swiglu_limit=0.0,
        swiglu_alpha=0.0,
        method="BF16",
    )
    assert w.num_gpu_experts == 0 and set(KT_072_PARAMS) - named <= {
        "lora_rank",
        "lora_alpha",
        "lora_dropout",
        "max_cache_depth",
        "group_size",
        "zero_point",
        "full_weight_grad",
        "swiglu_limit",
        "swiglu_alpha",
    }


@pytest.mark.parametrize("api", ["kt072", "sglang0523"])
def test_both_apis_skip_gpu_experts_and_match_reference(api, experts):
    mask = torch.zeros(E, dtype=torch.bool)
    mask[:3] = True
    w = kt072(mask=mask) if api == "kt072" else sglang_0523(num_gpu=3)
    assert w.num_gpu_experts == 3 and torch.equal(w.gpu_experts_mask, mask)
    w.load_weights_from_tensors(*experts, torch.arange(E))
    x = torch.randn(5, H).to(torch.bfloat16)
    ids, wt = routing(5, E, K)
    out = w.forward(x, ids, wt, None)
    assert out.dtype == torch.bfloat16 and out.device == x.device and out.shape == (5, H)
    assert rel_err(out, ref_moe(x, ids, wt, *experts, skip=mask)) < 0.01
    out32 = w.forward(x.float(), ids, wt.to(torch.bfloat16), None)
    assert out32.dtype == torch.float32


def test_physical_to_logical_map(experts):
    w = sglang_0523()
    perm = torch.randperm(E)
    w.load_weights_from_tensors(*experts, perm)
    x = torch.randn(3, H).to(torch.bfloat16)
    ids, wt = routing(3, E, K)
    assert rel_err(w.forward(x, ids, wt), ref_moe(x, perm[ids], wt, *experts)) < 0.01


def test_inputs_are_copied_at_submit(experts):
    """SGLang masks topk_ids in place right after submit_forward (mask_cpu_expert_ids)."""
    w = sglang_0523()
    w.load_weights_from_tensors(*experts)
    x = torch.randn(4, H).to(torch.bfloat16)
    ids, wt = routing(4, E, K)
    want = ref_moe(x, ids, wt, *experts)
    w.submit_forward(x, ids, wt, None)
    ids.fill_(-1)
    x.zero_()
    assert rel_err(w.sync_forward(x, None), want) < 0.01


def test_method_names_map_or_refuse(caplog):
    for name, fmt in (
        ("AMXINT4", "int4"),
        ("AMXINT8", "int8"),
        ("BF16", "bf16"),
        ("MOE_INT8", "int8"),
        ("RAWINT4", "int4"),
        ("moe_int4", "int4"),
    ):
        assert methods.resolve(name).format == fmt
    with caplog.at_level("INFO", logger="kvplugins.kt"):
        methods.resolve("AMXINT8")
    assert "AVX512-VNNI" in caplog.text
    for bad in ("FP8", "LLAMAFILE", "GPTQ_INT4", "int3"):
        with pytest.raises(ConfigError, match="accepts: BF16, AMXINT8, AMXINT4, MOE_INT8"):
            methods.resolve(bad)
    with pytest.raises(ConfigError, match="inference only"):
        KTMoEWrapper(0, E, K, H, I, None, 1, 1, "", 64, mode="sft", method="BF16")


def test_bad_constructor_arguments():
    with pytest.raises(ConfigError, match="disagrees"):
        KTMoEWrapper(0, E, K, H, I, torch.ones(E, dtype=torch.bool), 1, 1, "", 64, num_gpu_experts=2, method="BF16")
    with pytest.raises(ConfigError, match="gpu_experts_mask has"):
        KTMoEWrapper(0, E, K, H, I, torch.ones(3, dtype=torch.bool), 1, 1, "", 64, method="BF16")
    with pytest.raises(ConfigError, match="max_deferred"):
        KTMoEWrapper(0, E, K, H, I, None, 1, 1, "", 64, max_deferred_experts_per_token=K, method="BF16")
    with pytest.raises(ConfigError, match="load_weights needs weight_path"):
        sglang_0523().load_weights(torch.arange(E))


def test_deferral_split_protects_top_weights_batch_wide():
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 0]])
    wt = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    now, later = deferral.split(ids, wt, E, 2)
    # token 0 protects {0,1}, token 1 protects {4,5}; expert 0 is protected batch-wide, so (1, 0) runs now
    assert now.tolist() == [[0, 1, -1, -1], [4, 5, -1, 0]]
    assert later.tolist() == [[-1, -1, 2, 3], [-1, -1, 6, -1]]
    assert deferral.split(ids, wt, E, 0)[1] is None


def test_deferred_experts_land_in_the_next_layer(experts):
    """Layer 0 (d=2) returns only its protected experts; layer 1 (last, d=0) returns its own full output plus
    layer 0's deferred experts; nothing is left pending."""
    l0, l1 = sglang_0523(layer_idx=100, deferred=2), sglang_0523(layer_idx=101, deferred=0)
    for w in (l0, l1):
        w.load_weights_from_tensors(*experts)
    x0, x1 = torch.randn(6, H).to(torch.bfloat16), torch.randn(6, H).to(torch.bfloat16)
    ids0, wt0 = routing(6, E, K, seed=4)
    ids1, wt1 = routing(6, E, K, seed=5)
    now, later = deferral.split(ids0, wt0, E, 2)
    y0 = l0.forward(x0, ids0, wt0)
    y1 = l1.forward(x1, ids1, wt1)
    assert rel_err(y0, ref_moe(x0, now, wt0, *experts)) < 0.01
    assert rel_err(y1, ref_moe(x1, ids1, wt1, *experts) + ref_moe(x0, later, wt0, *experts)) < 0.01
    assert 101 not in l0.engine.pending and 102 not in l0.engine.pending


def test_dropping_a_layer_with_queued_work_is_safe(experts):
    """A wrapper freed right after submit (its deferred job still queued) must not free weights under the job."""
    import gc

    x = torch.randn(64, H).to(torch.bfloat16)
    ids, wt = routing(64, E, K)
    for _ in range(3):
        w = sglang_0523(layer_idx=200, deferred=2)
        w.load_weights_from_tensors(*experts)
        w.submit_forward(x, ids, wt)
        del w
        gc.collect()
    nxt = sglang_0523(layer_idx=201)
    nxt.load_weights_from_tensors(*experts)
    now, later = deferral.split(ids, wt, E, 2)
    got = nxt.forward(x, ids, wt)
    assert rel_err(got, ref_moe(x, ids, wt, *experts) + ref_moe(x, later, wt, *experts)) < 0.01


def test_idle_pool_sleeps(experts):
    """kt-kernel users see 100% CPU while idle (kt#1836): our workers sleep after a short spin."""
    w = sglang_0523()
    w.load_weights_from_tensors(*experts)
    x = torch.randn(2, H).to(torch.bfloat16)
    ids, wt = routing(2, E, K)
    w.forward(x, ids, wt)
    time.sleep(0.05)  # past the spin window
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    time.sleep(0.5)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.05 * wall, f"idle process used {cpu:.3f} s CPU in {wall:.2f} s"
