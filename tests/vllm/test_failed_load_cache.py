"""A failed load must not stay in vLLM's prefix cache, driven with vLLM's own scheduler-side objects (no engine).

vLLM 0.32 caches a synchronous load's blocks under their hashes when it allocates them
(``KVCacheManager.allocate_slots``), before the worker has loaded anything. When the load fails with policy
"recompute", vLLM only rewinds the request; the blocks stay cached until that request recomputes them. A
request preempted before that, or a new one sharing the prefix, would take the failed (zeroed) blocks as a
local hit and compute on them. The connector evicts failed blocks from the cache manager vLLM binds to it.
"""

from __future__ import annotations

import socket

import pytest
from helpers.installed import require

require("vllm", "bash ci/install.sh")

BLOCK = 32


def _dead_master() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def scheduler_side(model):
    """(connector in the scheduler role, vLLM's KVCacheManager bound to it, a request factory)."""
    import torch
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from kvplugins.vllm_kv_connector.connector import KVPluginsConnector

    ktc = KVTransferConfig(
        kv_connector="KVPluginsConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"store": {"master": _dead_master(), "rpc_timeout_ms": 300}},
    )
    cfg = EngineArgs(
        model=model, dtype="float32", block_size=BLOCK, enforce_eager=True, max_model_len=2048, kv_transfer_config=ktc
    ).create_engine_config()
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(cfg.model_config.hf_config.num_hidden_layers)]
    spec = FullAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=cfg.model_config.get_num_kv_heads(cfg.parallel_config),
        head_size=cfg.model_config.get_head_size(),
        dtype=torch.float32,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    connector = KVPluginsConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)
    manager = KVCacheManager(
        kv_cache_config, max_model_len=2048, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True
    )
    connector.bind_kv_cache_manager(manager)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)

    def request(req_id: str, tokens: list[int]):
        return Request(req_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=hasher)

    yield connector, manager, request
    connector.shutdown()


def test_failed_sync_load_leaves_the_prefix_cache(scheduler_side):
    from vllm.v1.outputs import KVConnectorOutput

    connector, manager, request = scheduler_side
    prompt = list(range(1, 3 * BLOCK + 2))  # 3 full pages and a token
    first = request("a", prompt)
    # a synchronous external hit of 2 pages, then the rest of the prompt to compute (as vLLM's scheduler does)
    manager.allocate_slots(first, num_new_tokens=len(prompt) - 2 * BLOCK, num_external_computed_tokens=2 * BLOCK)
    blocks = manager.get_block_ids("a")[0]
    _, hit, _ = manager.get_computed_blocks(request("b", prompt))
    assert hit == 3 * BLOCK  # control: vLLM cached the pages being loaded at allocation

    connector.update_connector_output(KVConnectorOutput(invalid_block_ids={blocks[1]}))  # page 1 failed
    _, hit, _ = manager.get_computed_blocks(request("c", prompt))
    assert hit == BLOCK  # page 0 loaded and is still a hit; page 1 (and what hangs on it) is not
    assert manager.get_block_ids("a")[0] == blocks  # the request keeps its blocks and recomputes page 1
