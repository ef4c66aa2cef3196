"""Real vLLM engines (fresh processes, CPU) sharing KV through a real store on loopback.

Engine A computes first turns and saves their pages; a fresh engine B gets the next turns and must (1) load
the shared prefix from the store, in the background (an asynchronous hit), and (2) produce the same greedy
tokens as an engine without the connector. Both name the connector only ("kv_connector":"KVPluginsConnector",
no module path): the vllm.general_plugins entry point registers it. Then, each on the pages A and B stored
(a test that damages pages puts them back, so the tests run in any order): a preempted batch reloads from the
store (connector inside MultiConnector); a page that fails to load is recomputed; with policy "fail" a page
failing its checksum fails only its request; corrupted pages change the tokens (the loaded KV is really used);
on a copy of the pages in a cluster of its own, the store node is stopped and then killed in the middle of the
loads (everything recomputed, identical tokens, no hang). With the store down the engine still serves, with
identical tokens.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
from helpers.installed import require
from helpers.cluster import store_cluster
from kvp_vllm_helpers import BLOCK, engine_pair, flipped, object_bytes, replace_pages, restored, stored_page_keys

from kvplugins.demo.engine import EngineSpec, run_fresh

require("vllm", "bash ci/install.sh")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster():
    """One store node; the master keeps a silent node's pages listed for 120 s, so a frozen node still
    answers lookups (its pages are found, then fail to load) instead of vanishing after 3 s."""
    with store_cluster(nodes=1, segment_size="256MiB", master_flags={"heartbeat_timeout_ms": 120000}) as c:
        yield c


@pytest.fixture(scope="module")
def shared(model, turn_prompts, cluster, tmp_path_factory):
    """Engine A then a fresh engine B, both with the connector; returns (A, B, namespace file content)."""
    return engine_pair(model, turn_prompts, cluster.master, tmp_path_factory.mktemp("ns") / "namespace.json")


def test_fresh_instance_gets_external_hits_and_identical_tokens(shared, baseline):
    a, b, _ = shared
    assert a["external_hit_tokens"] == 0
    shared_pages = sum(n // BLOCK for n in a["prompt_tokens"])  # A's full pages are B's prefix
    assert b["external_hit_tokens"] == shared_pages * BLOCK > 1000
    assert b["tokens"] == baseline["tokens"]
    assert all(len(t) == 16 for t in b["tokens"])
    stats = b["kvplugins"]  # the connector's counters, as vLLM's Prometheus metrics show them
    assert stats["async_blocks"] == stats["loaded_blocks"] == shared_pages
    assert stats["hit_blocks"] == shared_pages and stats["failed_blocks"] == 0
    assert stats["loaded_bytes"] == shared_pages * b_page_bytes(shared)
    assert a["kvplugins"]["saved_blocks"] >= shared_pages and a["kvplugins"]["miss_blocks"] > 0
    assert shared[2]["keyspace"]["extra"].endswith(";layout=CPU_ATTN:LBHNC")  # the CPU backend's resolved layout


def b_page_bytes(shared) -> int:
    return shared[2]["keyspace"]["page_bytes"]


def test_preempted_batch_reloads_from_the_store(shared, baseline, model, turn_prompts, cluster):
    """Both prompts at once in a KV cache too small for both to decode: vLLM preempts one (its blocks freed
    while its saves may be in flight); it comes back through a store load. The connector runs as a child of
    MultiConnector (whose stats lookups go by connector name)."""
    blocks = sum(-(-n // BLOCK) for n in baseline["prompt_tokens"]) + 1
    child = {
        "kv_connector": "KVPluginsConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": {"master": cluster.master}},
    }
    multi = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [child]}}
    r = run_fresh(
        EngineSpec(
            model,
            turn_prompts[1],
            max_tokens=48,
            batch=True,
            num_blocks=blocks,
            max_model_len=2048,
            connector={},
            transfer=multi,
        )
    )
    assert r["preemptions"] > 0
    assert [t[:16] for t in r["tokens"]] == baseline["tokens"]
    assert r["kvplugins"]["loaded_blocks"] > 0  # stats flowed through MultiConnector to /metrics


def test_page_that_fails_to_load_is_recomputed(shared, baseline, model, turn_prompts, cluster, tmp_path):
    from kvplugins.store import ClientConfig, StoreClient

    _, b, info = shared
    log = tmp_path / "engine.log"
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        stored = stored_page_keys(client, b, info)
        with restored(client, stored[5:6]):
            replace_pages(client, stored[5:6], object_bytes(info) // 2)  # wrong size: load fails
            r = run_fresh(
                EngineSpec(
                    model, turn_prompts[1], connector={"store": {"master": cluster.master}}, load_failure="recompute"
                ),
                log_path=str(log),
            )
    assert "1 of" in log.read_text() and "pages failed to load" in log.read_text()
    assert r["tokens"] == baseline["tokens"]
    assert r["kvplugins"]["failed_blocks"] == 1


def test_fail_policy_fails_only_that_request_with_a_clear_error(
    shared, baseline, model, turn_prompts, cluster, tmp_path
):
    """A stored page whose bytes no longer match its checksum, with kv_load_failure_policy="fail": the request
    that loads it ends with finish_reason "error" (vLLM logs why, the connector names the page and the cause);
    the engine neither hangs nor crashes: the next request in the same engine gets the baseline's tokens."""
    from kvplugins.store import ClientConfig, StoreClient

    _, b, info = shared
    log = tmp_path / "engine.log"
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        stored = stored_page_keys(client, b, info)
        with flipped(client, stored[2:3]):  # page 2 of prompt 0
            r = run_fresh(
                EngineSpec(
                    model, turn_prompts[1], connector={"store": {"master": cluster.master}}, load_failure="fail"
                ),
                timeout_s=240,
                log_path=str(log),
            )
    text = log.read_text()
    assert r["finish_reasons"] == ["error", "length"]
    assert "Failing 1 request(s) due to KV load failure (failure_policy=fail" in text
    assert f"{stored[2]}: bytes read do not match the object's checksum" in text  # which page, and why
    assert r["tokens"][1] == baseline["tokens"][1]
    assert r["kvplugins"]["failed_blocks"] == 1


def test_corrupted_pages_change_tokens(shared, baseline, model, turn_prompts, cluster):
    from kvplugins.store import ClientConfig, StoreClient

    _, b, info = shared
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        stored = stored_page_keys(client, b, info)
        with restored(client, stored):
            replace_pages(client, stored, object_bytes(info))
            bad = run_fresh(EngineSpec(model, turn_prompts[1], connector={"store": {"master": cluster.master}}))
    assert bad["external_hit_tokens"] >= b["external_hit_tokens"]  # B saved its own pages too
    assert bad["tokens"] != baseline["tokens"]


def test_store_down_still_serves_identical_tokens(model, turn_prompts, baseline, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    log = tmp_path / "engine.log"
    r = run_fresh(
        EngineSpec(model, turn_prompts[1], connector={"store": {"master": dead, "rpc_timeout_ms": 300}}),
        log_path=str(log),
    )
    assert r["external_hit_tokens"] == 0
    assert r["tokens"] == baseline["tokens"]
    assert "store unavailable, serving without it" in log.read_text()


@pytest.fixture
def copied(shared, cluster):
    """A cluster of its own (one node; the master keeps a silent node's pages listed for 120 s) holding a copy
    of B's prompt pages from the module's cluster, for a test that kills its node."""
    from kvplugins.store import ClientConfig, StoreClient

    _, b, info = shared
    with StoreClient(ClientConfig(master=cluster.master)) as client:
        keys = stored_page_keys(client, b, info)
        values = client.batch_get(keys)
    with store_cluster(nodes=1, segment_size="256MiB", master_flags={"heartbeat_timeout_ms": 120000}) as own:
        with StoreClient(ClientConfig(master=own.master)) as client:
            assert not any(client.batch_put(keys, values))
        yield own


def test_node_killed_mid_load_recomputes_identical_tokens(shared, baseline, model, turn_prompts, copied, tmp_path):
    """The only store node is frozen (SIGSTOP: its TCP reads stall) before the engine starts, then SIGKILLed
    once the engine serves, while its loads wait on it. Every page fails; vLLM recomputes (policy "recompute")
    and the tokens equal the baseline."""
    node = copied.nodes[0]
    log = tmp_path / "engine.log"
    spec = EngineSpec(
        model,
        turn_prompts[1],
        connector={"store": {"master": copied.master, "transports": "tcp", "transfer_timeout_ms": 60000}},
    )
    box: dict = {}
    runner = threading.Thread(target=lambda: box.update(r=run_fresh(spec, log_path=str(log))), daemon=True)
    node.popen.send_signal(signal.SIGSTOP)
    runner.start()
    while runner.is_alive() and "init engine" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    time.sleep(3)  # the first prompt's load is now waiting on the frozen node
    node.kill()
    t_kill = time.monotonic()
    runner.join(timeout=240)
    assert "r" in box, f"engine run did not finish; log tail:\n{log.read_text()[-3000:]}"
    r = box["r"]
    assert time.monotonic() - t_kill < 45  # the kill ended the stalled loads, not the 60 s transfer timeout
    assert r["kvplugins"]["failed_blocks"] > 0 and r["kvplugins"].get("loaded_blocks", 0) == 0
    assert r["tokens"] == baseline["tokens"]
