"""A Mamba-state hybrid through real vLLM engines (CPU, fresh processes) and a real store on loopback: a tiny
random-weight LFM2 (Lfm2ForCausalLM: gated short-convolution layers beside full-attention ones; vLLM keeps the
convolution state in a Mamba KV cache group, "align" prefix caching). Engine A computes the first turns and
saves every full-attention page plus the state blocks vLLM hands over at page boundaries
(``boundary_state_offloads``); a fresh engine B must load the next turns' shared prefix (every attention page
and only the state at the hit's last page, as vLLM's MambaManager hits) and produce the greedy tokens of an
engine without the connector. Control: the state pages B loaded, overwritten with random bytes, change the
tokens of a fresh engine C (the convolution state really comes from the store)."""
from __future__ import annotations

import pytest
from kvp_vllm_helpers import BLOCK, engine_pair, page_keys, replace_pages

from kvplugins.demo.engine import EngineSpec, run_fresh

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def runs(turn_prompts, cluster, tmp_path_factory) -> dict:
    """The LFM2 model; B's prompts on an engine without the connector (baseline); engine A then a fresh engine
    B with the connector (a, b) and B's namespace file (info)."""
    from kvplugins.demo.model import ensure_model
    model = str(ensure_model(family="lfm2"))
    a, b, info = engine_pair(model, turn_prompts, cluster.master, tmp_path_factory.mktemp("ns") / "namespace.json")
    return dict(model=model, baseline=run_fresh(EngineSpec(model, turn_prompts[1])), a=a, b=b, info=info)


def _state_space(info) -> dict:
    (state,) = [g for g in info["groups"] if "conv" in g["layer_group"]]
    return state


def test_mamba_fresh_instance_gets_external_hits_and_identical_tokens(runs):
    a, b, info = runs["a"], runs["b"], runs["info"]
    assert len(info["groups"]) == 2 and _state_space(info)["extra"].count("layout=") == 1
    shared_pages = [n // BLOCK for n in a["prompt_tokens"]]  # A's full pages are B's prefix
    assert b["external_hit_tokens"] == sum(shared_pages) * BLOCK > 1000
    assert b["tokens"] == runs["baseline"]["tokens"] and all(len(t) == 16 for t in b["tokens"])
    stats = b["kvplugins"]
    assert stats["loaded_blocks"] == sum(shared_pages) + len(shared_pages)  # attention pages + one state each
    assert stats["failed_blocks"] == 0 and stats["hit_blocks"] == sum(shared_pages)


def test_mamba_corrupted_state_pages_change_tokens(runs, turn_prompts, cluster):
    from kvplugins.store import ClientConfig, StoreClient
    b, info = runs["b"], runs["info"]
    state = _state_space(info)
    ends = [(len(ids) - 1) // BLOCK for ids in b["prompt_token_ids"]]  # C's hits end where B's saved pages end
    keys = [page_keys(state, ids)[end - 1] for ids, end in zip(b["prompt_token_ids"], ends)]
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        assert all(client.batch_exists(keys))  # B saved the state at its prompts' last full pages
        replace_pages(client, keys, state["page_bytes"])
    bad = run_fresh(EngineSpec(runs["model"], turn_prompts[1], connector={"master": cluster.master}))
    assert bad["external_hit_tokens"] == sum(ends) * BLOCK and bad["kvplugins"]["failed_blocks"] == 0
    assert bad["kvplugins"]["loaded_blocks"] == sum(ends) + len(ends)   # the corrupted states were loaded
    assert bad["tokens"] != runs["baseline"]["tokens"]
