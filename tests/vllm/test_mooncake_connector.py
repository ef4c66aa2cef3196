"""vLLM 0.32's in-tree MooncakeStoreConnector (issue #19) on our store, unchanged: ``kvplugins mooncake enable``
(into a throw-away site dir, put on the engines' PYTHONPATH) makes its ``from mooncake.store import ...`` our
compat client, and MOONCAKE_CONFIG_PATH names our master as ``master_server_address``. Engine A computes the
first turns and saves their pages through the connector; a fresh engine B gets the next turns, loads the
shared prefix from our store (external hits) and produces the same greedy tokens as an engine without it."""

from __future__ import annotations

import json

import pytest
from helpers.installed import require
from helpers.cluster import store_cluster

from kvplugins.demo.engine import EngineSpec, run_fresh
from kvplugins.mooncake import shim as mooncake_shim
from kvplugins.store.client.connect import control_client

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_vllm_mooncake_store_connector_on_our_store(model, turn_prompts, baseline, tmp_path):
    mooncake_shim.enable(tmp_path / "site", force=True)
    with store_cluster(nodes=1, segment_size="256MiB", tmp=tmp_path / "store") as c:
        cfg = tmp_path / "mooncake.json"
        cfg.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": c.master,
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": "64MB",
                }
            )
        )
        env = {
            "PYTHONPATH": str(tmp_path / "site" / mooncake_shim.SHIM.shim_dir),
            "MOONCAKE_CONFIG_PATH": str(cfg),
            "VLLM_HOST_IP": "127.0.0.1",
        }  # vLLM passes its host IP as local_hostname: bind loopback
        transfer = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
        run_fresh(EngineSpec(model, turn_prompts[0], connector={}, transfer=transfer, env=env))
        ctl = control_client(c.master, 3000)
        stored = ctl.call("status")["objects"]
        ctl.close()
        b = run_fresh(EngineSpec(model, turn_prompts[1], connector={}, transfer=transfer, env=env))
    print(
        f"stored {stored} objects; B external hits {b['external_hit_tokens']} of {sum(b['prompt_tokens'])} "
        "prompt tokens"
    )
    assert stored > 0  # A's pages went into our store
    assert b["external_hit_tokens"] > 1000  # B loaded the shared prefix from it
    assert b["tokens"] == baseline["tokens"]
