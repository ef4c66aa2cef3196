"""P/D disaggregation with real vLLM OpenAI servers: a prefill instance (kv_producer) and a decode instance
(kv_consumer) behind `kvplugins pd-proxy` (in-process). Each path gets its own prompt (so the decode side's
local prefix cache cannot serve it): through the store, and direct (decode reads the prefill side's KV blocks
through the transfer core). The decode side's tokens must equal a single instance's (no connector), and its
GET /metrics must count the pages it loaded (vllm:kvplugins_* counters and load-latency histogram). Both servers
name the connector only by "kv_connector" (the vllm.general_plugins entry point registers it)."""
from __future__ import annotations

import threading
import time

import pytest
from kvp_vllm_helpers import BLOCK, Server, http_json

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def pd(model, cluster, tmp_path_factory):
    from kvplugins.cli.pd_proxy import PDProxyConfig, serve
    d = tmp_path_factory.mktemp("pd")
    # decode waits up to pd_wait_ms for the producer's saves: a loaded 2-vCPU CI host once needed more than the
    # 5 s default for the first request of both servers ("0 of the producer's 53 pages in the store after 5000 ms")
    extra = {"master": cluster.master, "pd_wait_ms": 30000}
    prefill = Server(model, {"kv_connector": "KVPluginsConnector", "kv_role": "kv_producer",
                             "kv_connector_extra_config": extra}, d / "prefill.log")
    decode = Server(model, {"kv_connector": "KVPluginsConnector", "kv_role": "kv_consumer",
                            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra},
                    d / "decode.log", env={"VLLM_SERVER_DEV_MODE": "1"})  # dev mode: POST /reset_prefix_cache
    proxy = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        proxy = serve(PDProxyConfig(prefill=prefill.url, decode=decode.url))
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{proxy.server_address[1]}"
        _warm_up(url, model)
        yield prefill, decode, url
    finally:
        if proxy is not None:
            proxy.shutdown()
        prefill.stop()
        decode.stop()


def _warm_up(proxy: str, model: str) -> None:
    """One P/D round per path on a prompt no test uses, before the measured requests: on a loaded 2-vCPU CI
    host the first handoff of a fresh server pair has outlived the 30 s waits (the producer's first put not
    committed within put_timeout_ms; once its lease not seen within pd_wait_ms), and decode computed the prompt
    (tokens right). That first-handoff delay is an open bug (docs/vllm.md); the measured requests below then
    assert every page moves."""
    prompt = " ".join(["warm"] * 200)
    for mode in ("store", "direct"):
        http_json(proxy + "/v1/completions", {"model": model, "prompt": prompt + " " + mode, "max_tokens": 2,
                                              "temperature": 0, "kv_transfer_params": {"kvplugins_mode": mode}})


@pytest.mark.parametrize("mode,index", [("store", 0), ("direct", 1)])
def test_pd_tokens_equal_single_instance(pd, baseline, model, turn_prompts, mode, index):
    """Every attempt's tokens must equal the single instance's; at least one of two handoffs (decode's prefix
    cache reset between them) must move every page by ``mode``: a handoff that outlives the 30 s waits on an
    overloaded host (the open bug above) falls back to the store or to recompute, and both attempts' connector
    log lines are the failure message."""
    prefill, decode, proxy = pd
    pages = (baseline["prompt_tokens"][index] - 1) // BLOCK
    body = {"model": model, "prompt": turn_prompts[1][index], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": {"kvplugins_mode": mode}}
    seen = []
    for attempt in range(2):
        if attempt:
            http_json(decode.url + "/reset_prefix_cache", {})
        before = decode.metrics()
        out = http_json(proxy + "/v1/completions", body)
        assert out["choices"][0]["token_ids"] == baseline["tokens"][index]
        time.sleep(1.5)  # the last steps' stats reach /metrics
        after = decode.metrics()

        def delta(name):
            return after.get(f"vllm:kvplugins_{name}_total", 0) - before.get(f"vllm:kvplugins_{name}_total", 0)
        assert delta("saved_blocks") == 0  # a consumer does not save
        assert after["vllm:kvplugins_load_seconds_count"] > before.get("vllm:kvplugins_load_seconds_count", 0)
        moved = (delta("loaded_blocks"), delta("failed_blocks"), delta("direct_blocks"))
        if moved == (pages, 0, pages if mode == "direct" else 0):
            return
        seen.append(f"attempt {attempt}: loaded, failed, direct pages {moved} of {pages}")
    raise AssertionError("\n".join(seen + [connector_lines(decode, prefill)]))


def connector_lines(*servers) -> str:
    """The connector's log lines of each server (why a direct read failed, how long it took)."""
    return "\n".join(f"{s.log_path.name}: {ln}" for s in servers for ln in s.log_path.read_text().splitlines()
                     if "kvplugins" in ln and ("WARNING" in ln or ln.startswith("kvplugins:")))


def test_pd_direct_read_without_the_producers_lease_falls_back_to_the_store(pd, baseline, model, turn_prompts):
    """Direct-path params whose token the producer never held (as after pd_hold_ms, or a producer restart):
    decode waits pd_wait_ms for the lease, does not read, and loads the pages from the store instead (the
    producer saved them too; a store read that outlives its lease on this loaded host is retried once); the
    tokens are still the single instance's."""
    prefill, decode, _ = pd
    body = {"model": model, "prompt": turn_prompts[1][0], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    params = http_json(prefill.url + "/v1/completions", {**body, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "kvplugins_mode": "direct"}})["kv_transfer_params"]
    params["kvplugins"]["token"] += 1 << 40  # a token the producer never leased
    http_json(decode.url + "/reset_prefix_cache", {})  # decode computed this prompt before: forget it locally
    before = decode.metrics()
    out = http_json(decode.url + "/v1/completions", {**body, "kv_transfer_params": params})
    assert out["choices"][0]["token_ids"] == baseline["tokens"][0]
    time.sleep(1.5)
    after = decode.metrics()
    pages = (baseline["prompt_tokens"][0] - 1) // BLOCK

    def delta(name):
        return after.get(f"vllm:kvplugins_{name}_total", 0) - before.get(f"vllm:kvplugins_{name}_total", 0)
    assert (delta("direct_blocks"), delta("loaded_blocks"), delta("failed_blocks")) == (0, pages, 0), \
        connector_lines(decode)
