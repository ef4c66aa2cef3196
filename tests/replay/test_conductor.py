"""The Conductor's cost model (kvplugins/router/cost.py) and ``kvplugins replay --routing conductor`` on its TTFT
model: a generated multi-turn trace over 4 instances with their own caches, under load and under overload, every
routing policy on the same clock; and once with the shared pool (a real embedded store)."""

from __future__ import annotations

import pytest

from kvplugins.errors import ConfigError
from kvplugins.replay.config import ReplayConfig
from kvplugins.replay.plan import execute
from kvplugins.router.cost import Candidate, Conductor, CostModel

MODEL = CostModel(prefill_tok_s=1000, load_bytes_s=1e9, block_tokens=100, block_bytes=10**8)


def test_the_prediction_is_queue_plus_uncached_prefill_plus_pool_load():
    assert MODEL.service_s(1000, 0, 0) == pytest.approx(1.0)
    assert MODEL.service_s(1000, 4, 0) == pytest.approx(0.6)  # 400 tokens in the instance's own cache
    assert MODEL.service_s(1000, 4, 3) == pytest.approx(0.3 + 0.3)  # 300 more from the pool: 0.3 GB at 1 GB/s
    assert MODEL.service_s(50, 4, 0) == 0.0  # a cache holding more than the prompt costs nothing
    c = Conductor(MODEL)
    busy_warm = Candidate(0, queue_s=0.5, local_blocks=8, pool_blocks=0)  # 0.5 + 0.2
    idle_cold = Candidate(1, queue_s=0.0, local_blocks=0, pool_blocks=0)  # 1.0
    idle_pool = Candidate(2, queue_s=-3.0, local_blocks=0, pool_blocks=5)  # 0 + 0.5 + 0.5 (a past queue is 0)
    d = c.choose(1000, [idle_cold, busy_warm, idle_pool])
    assert (d.index, d.predicted_s) == (0, pytest.approx(0.7))


def test_a_request_no_instance_can_serve_within_the_slo_is_rejected_at_once():
    c = Conductor(MODEL, slo_s=0.8)
    assert c.choose(1000, [Candidate(0, 0.0, 0, 0)]).rejected  # 1.0 s > 0.8 s
    assert c.choose(1000, [Candidate(0, 0.0, 0, 0), Candidate(1, 0.1, 5, 0)]).index == 1  # 0.6 s
    with pytest.raises(ConfigError, match="no instance"):
        c.choose(10, [])
    with pytest.raises(ConfigError, match="prefill_tok_s"):
        CostModel(0, 1, 1, 1)
    with pytest.raises(ConfigError, match="--prefill-tok-s"):
        ReplayConfig(routing="conductor")


def _rows(speed: float, slo_ms: float) -> dict[str, dict]:
    base = dict(synth=True, synth_requests=1500, instances=4, no_pool=True, local_capacity="3000", progress=False)
    model = dict(prefill_tok_s=8000, speed=speed, slo_ttft_ms=slo_ms)
    out = {}
    for routing in ("round_robin", "session", "prefix_aware", "conductor"):
        [row] = execute(ReplayConfig(**base, **model, routing=routing), None, say=lambda s: None)
        out[routing] = row
    return out


def test_under_load_the_conductor_has_the_best_goodput_and_tail():
    rows = _rows(speed=6, slo_ms=2000)
    best_other = max(r["goodput_rps"] for k, r in rows.items() if k != "conductor")
    c = rows["conductor"]
    assert c["goodput_rps"] >= best_other and c["rejected"] == 0
    assert c["ttft_ms"]["p99"] < min(r["ttft_ms"]["p99"] for k, r in rows.items() if k != "conductor")


def test_under_overload_early_rejection_keeps_the_admitted_within_the_slo():
    rows = _rows(speed=14, slo_ms=2000)
    c, rr = rows["conductor"], rows["round_robin"]
    best_other = max(r["goodput_rps"] for k, r in rows.items() if k != "conductor")
    assert c["rejected"] > 0 and c["slo_attainment"] == 1.0 and c["ttft_ms"]["p99"] <= 2000
    assert c["goodput_rps"] >= 1.5 * best_other and c["goodput_rps"] >= 1.5 * rr["goodput_rps"]
    assert rr["slo_attainment"] < 0.5  # admitted and late


def test_the_conductor_counts_the_shared_pool():
    cfg = ReplayConfig(
        synth=True, synth_requests=600, instances=4, local_capacity="200", pool_capacity="20000", progress=False,
        routing="conductor", prefill_tok_s=8000, speed=4, load_gbps=20,
    )  # fmt: skip
    [row] = execute(cfg, None, say=lambda s: None)
    assert row["pool_hit_ratio"] > 0.1 and row["ttft_ms"]["n"] == 600 and row["wrong_bytes"] == 0
