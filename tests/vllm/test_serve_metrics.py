"""A real vLLM OpenAI server (CPU) with the connector named only by "kv_connector" (entry point): a completion
runs, and GET /metrics shows the connector's counters (vllm:kvplugins_*)."""
from __future__ import annotations

import time

import pytest
from kvp_vllm_helpers import Server, http_json

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]


def test_metrics_endpoint_shows_connector_counters(model, turn_prompts, cluster, tmp_path):
    ktc = {"kv_connector": "KVPluginsConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"master": cluster.master}}
    server = Server(model, ktc, tmp_path / "serve.log")
    try:
        server.wait_ready()
        out = http_json(server.url + "/v1/completions", {"model": model, "prompt": turn_prompts[0][0],
                                                         "max_tokens": 4, "temperature": 0})
        assert len(out["choices"][0]["text"]) > 0
        time.sleep(1.5)  # the stats of the request's last steps reach the front-end
        m = server.metrics()
    finally:
        server.stop()
    assert {"vllm:kvplugins_miss_blocks_total", "vllm:kvplugins_saved_blocks_total",
            "vllm:kvplugins_save_seconds_count"} <= set(m)
    assert m["vllm:kvplugins_miss_blocks_total"] > 0  # a fresh store: every page missed
