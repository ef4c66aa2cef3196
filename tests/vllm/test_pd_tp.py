"""P/D between a prefill instance at TP 2 and a decode instance at TP 1 (issue #32), real vLLM OpenAI servers
behind `kvplugins router --decode`. Pages are stored per KV head (layout/shards.py), so the decode side reads, at
TP 1, the heads the prefill side's two TP ranks wrote; the direct path needs the same TP size on both sides,
so a request that asks for it is handed over through the store instead (the producer's workers exported KV
for 2 ranks, the consumer has 1). Decode's tokens must equal a single instance's, its /metrics must count
every prompt page loaded from the store and none read directly, and every handoff ends within 10 s (the
producer does not hold the blocks waiting for an ack that cannot come: that wait ends at pd_hold_ms, 30 s; a
handoff took 3.6 s once on 2 loaded CPUs, so 2 s was a speed bound, not a behaviour one)."""

from __future__ import annotations

import time

import pytest
from helpers.installed import require
from kvp_vllm_helpers import BLOCK, http_json, pd_pair

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def pd_tp(model, cluster, tmp_path_factory):
    with pd_pair(model, cluster.master, tmp_path_factory.mktemp("pd_tp"), prefill_tp=2) as servers:
        yield servers


@pytest.mark.parametrize("mode,index", [("store", 0), ("direct", 1)])
def test_tp2_prefill_hands_over_to_tp1_decode(pd_tp, baseline, model, turn_prompts, mode, index):
    prefill, decode, router = pd_tp
    pages = (baseline["prompt_tokens"][index] - 1) // BLOCK
    body = {
        "model": model,
        "prompt": turn_prompts[1][index],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": {"kvplugins_mode": mode},
    }
    before, held = decode.metrics(), prefill.buckets("pd_handoff_seconds")
    out = http_json(router + "/v1/completions", body)
    assert out["choices"][0]["token_ids"] == baseline["tokens"][index]

    def delta(name):
        return after.get(f"vllm:kvplugins_{name}_total", 0) - before.get(f"vllm:kvplugins_{name}_total", 0)

    deadline = time.monotonic() + 20.0  # the engines publish their last steps' stats to /metrics after the reply
    while True:  # (1.5 s was not always enough on 2 loaded CPUs); the counts are then checked exactly
        time.sleep(0.5)  # both: prefill's handoff can be published after decode's loads (seen in CI: 0 handoffs)
        after, held_after = decode.metrics(), prefill.buckets("pd_handoff_seconds")
        handed = held_after.get("+Inf", 0) > held.get("+Inf", 0)
        if delta("loaded_blocks") + delta("failed_blocks") + delta("direct_blocks") >= pages and handed:
            break
        if time.monotonic() > deadline:
            break

    logs = "\n".join(
        f"{s.log_path.name}: {ln}"
        for s in (decode, prefill)
        for ln in s.log_path.read_text().splitlines()
        if "kvplugins" in ln
    )
    moved = (delta("loaded_blocks"), delta("failed_blocks"), delta("direct_blocks"))
    assert moved == (pages, 0, 0), f"loaded, failed, direct pages {moved}, expected {(pages, 0, 0)}\n{logs}"
    n = held_after.get("+Inf", 0) - held.get("+Inf", 0)
    fast = held_after.get("10.0", 0) - held.get("10.0", 0)
    assert n >= 1 and fast == n, f"handoffs {n}, within 10 s {fast}\n{logs}"
