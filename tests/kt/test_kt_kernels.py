"""Native MoE kernels (kvplugins._moe) against a torch fp32 reference on real model shapes.

Two checks per format: against the reference run on the *dequantized* weights (isolates kernel errors: only
activation rounding remains) and against the bf16 weights (the quantization error users see)."""

import functools

import pytest
import torch

from kt_ref import dequantized, ref_moe, random_experts, rel_err, routing
from kvplugins.errors import ConfigError
from kvplugins.kt_expert_backend import native

# (name, E reduced for memory/time, H, I, top-k); the real models have E=64 and E=128
SHAPES = [("deepseek-v2-lite", 8, 2048, 1408, 6), ("qwen3-30b-a3b", 12, 2048, 768, 8)]
# kernel-vs-dequantized tolerance, and vs-bf16-weights tolerance, per format
TOL = {"bf16": (0.01, 0.01), "int8": (0.03, 0.05), "int4": (0.03, 0.25)}


@pytest.fixture(scope="module")
def pool():
    return native.Pool(2, 1, spin_us=50)


@functools.lru_cache(maxsize=2)
def _experts(E, H, I):
    return random_experts(E, H, I)


def _layer(fmt, isa, E, H, I, w, pool, group=128):
    layer = native.Layer(fmt, E, H, I, group=group, isa=isa)
    for e in range(E):
        for name, m in zip(("gate", "up", "down"), w):
            layer.set_float(pool, e, name, m[e])
    return layer


@pytest.mark.parametrize("fmt", native.FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_real_shapes_match_reference(shape, fmt, pool):
    _, E, H, I, K = shape
    w = _experts(E, H, I)
    layer = _layer(fmt, "auto", E, H, I, w, pool)
    deq = w if fmt == "bf16" else [dequantized(fmt, m) for m in w]
    for T in (1, 4, 37):
        x = (torch.randn(T, H, generator=torch.Generator().manual_seed(T))).to(torch.bfloat16)
        ids, wt = routing(T, E, K, seed=T)
        out = torch.empty(T, H)
        layer.forward(pool, x, ids, wt, None, out)
        assert rel_err(out, ref_moe(x, ids, wt, *deq)) < TOL[fmt][0]
        if fmt != "bf16":
            assert rel_err(out, ref_moe(x, ids, wt, *w)) < TOL[fmt][1]


@pytest.mark.parametrize("isa", native.ISAS + (native.EMULATED,))
@pytest.mark.parametrize("fmt,group", [("bf16", 0), ("int8", 0), ("int4", 64), ("int4", 128)])
def test_every_tier_matches_torch_reference(isa, fmt, group, pool):
    """Each tier this CPU runs, alone, against the torch fp32 reference on the dequantized weights at T = 1, 2,
    3, 4, 6 (decode tiles), 77 and 128 (prefill: AMX runs 1-4 blocks of 16 tokens per expert, the last one
    partial); a tier the CPU lacks is skipped, visibly. amx_emulated runs the amx tier's code with the tile
    instructions emulated (mocked: no CI CPU has AMX); the real amx tier runs only where the CPU has AMX."""
    if isa not in native.supported_isas(emulated=True):
        pytest.skip(f"this CPU cannot run the {isa} tier ({native.best_isa_reason()})")
    E, H, I, K = 4, 256, 384, 2
    w = random_experts(E, H, I, seed=5)
    layer = _layer(fmt, isa, E, H, I, w, pool, group=group or 64)
    assert layer.isa == isa
    deq = [dequantized(fmt, m, group or 64) for m in w]
    for T in (1, 2, 3, 4, 6, 77, 128):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
        ids, wt = routing(T, E, K, seed=T)
        out = torch.empty(T, H)
        layer.forward(pool, x, ids, wt, None, out)
        assert rel_err(out, ref_moe(x, ids, wt, *deq)) < 2 * TOL[fmt][0], (T, isa)  # 2x: small H, see below


def test_forced_tier_and_refused_tier(monkeypatch):
    """KVPLUGINS_KT_ISA forces any tier this CPU runs (kvplugins kt status says so); a tier it lacks, or an
    unknown one, is refused with a ConfigError naming the tiers it can run."""
    from kvplugins.config import load
    from kvplugins.kt_expert_backend.config import KTConfig

    for isa in native.supported_isas():
        monkeypatch.setenv("KVPLUGINS_KT_ISA", isa)
        assert native.resolve_isa(load(KTConfig).isa) == isa
        assert native.describe_isa(load(KTConfig).isa).startswith(f"{isa} (forced")
    assert native.describe_isa("auto").startswith(f"{native.best_isa()} (")
    lacking = [i for i in native.ISAS if i not in native.supported_isas()]
    for isa in lacking + ["avx1024"]:
        with pytest.raises(ConfigError, match="scalar"):
            native.resolve_isa(isa)


@pytest.mark.parametrize("fmt,group", [("bf16", 0), ("int8", 0), ("int4", 64), ("int4", 128)])
def test_every_isa_variant_agrees(fmt, group, pool):
    """Every tier this CPU runs (scalar, avx2, avx512, avx512_bf16, amx, amx_emulated) agrees with scalar at every
    decode size (each picks its own tile) and at two prefill sizes, for both INT4 block orders (group 64: one packed block per step; 128: two per load, with
    the activations reordered). Not bit for bit: float summation order and the vectorized exp differ in the last
    bits, which can flip the bf16/u8 rounding of a few h values (~1e-4)."""
    E, H, I, K = 4, 256, 384, 2
    group = group or 64  # ignored by bf16 and int8
    w = random_experts(E, H, I, seed=3)
    layers = {isa: _layer(fmt, isa, E, H, I, w, pool, group=group) for isa in native.supported_isas(emulated=True)}
    assert "scalar" in layers and len(layers) >= 2 or native.best_isa() == "scalar"
    deq = [dequantized(fmt, m, group) for m in w]
    for T in (1, 2, 3, 4, 6, 40, 77):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
        ids, wt = routing(T, E, K, seed=T)
        outs = {}
        for isa, layer in layers.items():
            outs[isa] = torch.empty(T, H)
            layer.forward(pool, x, ids, wt, None, outs[isa])
        for isa, out in outs.items():
            assert rel_err(out, outs["scalar"]) < 1e-3, (isa, T)
        # twice the real-shape tolerance: with H=256 and T <= 6, one token's u8 rounding weighs more
        assert rel_err(outs["scalar"], ref_moe(x, ids, wt, *deq)) < 2 * TOL[fmt][0], T


def test_skip_mask_ids_and_accumulate(pool):
    E, H, I, K, T = 6, 128, 128, 3, 5
    w = random_experts(E, H, I, seed=5)
    layer = _layer("bf16", "auto", E, H, I, w, pool)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, wt = routing(T, E, K)
    ids[0, 1] = -1
    skip = torch.zeros(E, dtype=torch.bool)
    skip[[1, 4]] = True
    out = torch.full((T, H), 7.0)
    layer.forward(pool, x, ids, wt, skip, out, accumulate=True)
    assert rel_err(out - 7.0, ref_moe(x, ids, wt, *w, skip=skip)) < 0.01
    out2 = torch.full((T, H), 7.0)
    layer.forward(pool, x.float(), ids, wt, skip, out2)  # float32 input, overwrite
    assert rel_err(out2, ref_moe(x, ids, wt, *w, skip=skip)) < 0.01


def test_quantize_dequantize_roundtrip():
    m = torch.randn(64, 256)
    for fmt, tol in (("bf16", 0.005), ("int8", 0.01), ("int4", 0.12)):
        q, s = native.quantize(fmt, m, 64)
        assert rel_err(torch.from_numpy(native.dequantize(fmt, q, s, 64)), m) < tol


def test_set_quantized_equals_set_float(pool):
    E, H, I = 2, 128, 128
    w = random_experts(E, H, I, seed=9)
    a = _layer("int4", "auto", E, H, I, w, pool, group=64)
    b = native.Layer("int4", E, H, I, group=64)
    for e in range(E):
        for name, m in zip(("gate", "up", "down"), w):
            b.set_quantized(pool, e, name, *native.quantize("int4", m[e], 64))
    x = torch.randn(3, H).to(torch.bfloat16)
    ids, wt = routing(3, E, 2)
    oa, ob = torch.empty(3, H), torch.empty(3, H)
    a.forward(pool, x, ids, wt, None, oa)
    b.forward(pool, x, ids, wt, None, ob)
    assert torch.equal(oa, ob)


def test_bad_input_raises_clear_errors(pool):
    with pytest.raises(ConfigError, match="multiples of 64"):
        native.Layer("bf16", 2, 100, 128)
    with pytest.raises(ConfigError, match="group"):
        native.Layer("int4", 2, 128, 128, group=96)
    with pytest.raises(ConfigError, match="weight format"):
        native.Layer("fp8", 2, 128, 128)
    layer = _layer("bf16", "auto", 2, 128, 128, random_experts(2, 128, 128), pool)
    x, out = torch.zeros(1, 128, dtype=torch.bfloat16), torch.empty(1, 128)
    with pytest.raises(ConfigError, match="outside"):
        layer.forward(pool, x, torch.tensor([[5]]), torch.ones(1, 1), None, out)
    with pytest.raises(ConfigError, match="int64"):
        layer.forward(pool, x, torch.tensor([[1]], dtype=torch.int32), torch.ones(1, 1), None, out)
    with pytest.raises(ConfigError, match="shape"):
        layer.set_float(pool, 0, "gate", torch.zeros(64, 128))
    with pytest.raises(ConfigError, match="C-contiguous"):  # the result would land in a converted copy
        layer.forward(pool, x, torch.tensor([[1]]), torch.ones(1, 1), None, torch.empty(1, 256)[:, ::2])
    with pytest.raises(ConfigError, match="C-contiguous"):  # the queued job would read a freed copy
        layer.submit(
            pool,
            x.expand(2, 128).contiguous(),
            torch.tensor([[1, 0], [1, 0]])[:, :1],
            torch.ones(2, 1),
            None,
            torch.empty(2, 128),
        )
    strided = torch.zeros(2, 128, dtype=torch.bfloat16)[::2]  # forward's inputs may be converted: it blocks
    layer.forward(pool, strided, torch.tensor([[1]]), torch.ones(1, 1), None, out)
    assert torch.equal(out, torch.zeros(1, 128))
    unloaded = native.Layer("bf16", 2, 128, 128)
    with pytest.raises(ConfigError, match="never loaded"):
        unloaded.forward(pool, x, torch.tensor([[0]]), torch.ones(1, 1), None, out)


def test_subpools_split_rows_and_give_identical_results():
    """threadpool_count=2 on a one-node machine: no pinning (and says so), same bits as one subpool."""
    E, H, I, K, T = 4, 256, 256, 2, 9
    w = random_experts(E, H, I, seed=13)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, wt = routing(T, E, K)
    outs = []
    for threads, subpools in ((1, 1), (2, 2), (3, 2)):
        pool = native.Pool(threads, subpools, spin_us=0)
        assert f"{subpools} subpool" in pool.describe() and "pinned" in pool.describe()
        out = torch.empty(T, H)
        _layer("int8", "auto", E, H, I, w, pool).forward(pool, x, ids, wt, None, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(ConfigError, match="threadpool_count"):
        native.Pool(2, 3)


def test_wait_spin_gives_same_bits_and_job_errors():
    """Pool.wait polls for its job for wait_spin_us before sleeping (KTConfig.sync_spin_us): the results are the
    same bits as a sleeping wait, and an error raised inside the job still surfaces at wait."""
    E, H, I, K, T = 4, 256, 256, 2, 3
    w = random_experts(E, H, I, seed=17)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, wt = routing(T, E, K)
    outs = []
    for pool in (native.Pool(1, 1, spin_us=0), native.Pool(2, 1, spin_us=0, wait_spin_us=20000)):
        out = torch.empty(T, H)
        _layer("int8", "auto", E, H, I, w, pool).forward(pool, x, ids, wt, None, out)
        outs.append(out)
        unloaded = native.Layer("bf16", 2, H, 128)
        keep = (ids[:, :1] % 2, wt[:, :1].contiguous(), torch.empty(T, H))  # alive until wait returns
        ticket = unloaded.submit(pool, x, *keep[:2], None, keep[2])
        with pytest.raises(ConfigError, match="never loaded"):
            pool.wait(ticket)
    assert torch.equal(outs[0], outs[1])
    assert "wait spin 20000 us" in pool.describe()
