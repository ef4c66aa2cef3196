"""KVPluginsHiCacheStorage inside SGLang 0.5.23's own code, on CPU, against real store processes.

The backend is built by StorageBackendFactory from the JSON a user passes, attached to real MHA/MLA host pools,
and driven by the cache controller's own page IO helpers. A second process (hicache_worker.py) reads the
pages back bit-exact, acts as TP rank 1 of a TP=2 deployment and as a non-writer MLA rank.
"""

from __future__ import annotations

import inspect
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang not installed: bash ci/install-sglang.sh")

import hicache_case as hc  # noqa: E402
from helpers.cluster import store_cluster, up_process  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: E402

from kvplugins.errors import ConfigError  # noqa: E402
from kvplugins.sglang_hicache_backend import KVPluginsHiCacheStorage  # noqa: E402

WORKER = Path(__file__).with_name("hicache_worker.py")
CASES = hc.all_cases()


def run_worker(tmp_path: Path, master: str, steps: list[dict]) -> list[dict]:
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"master": master, "steps": steps}))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(job), str(out)], capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with store_cluster(nodes=1, segment_size="64MiB", tmp=tmp_path_factory.mktemp("store")) as c:
        yield c


@pytest.fixture(scope="module")
def shared(cluster, tmp_path_factory):
    """Phase 1 (this process, TP rank 0): write every case, a TP=2 shard and the MLA writer's pages.
    Phase 2 (worker process): read every case; write the TP rank-1 shard; as non-writer MLA rank 1, try to
    write other bytes, then read the writer's pages. Returns what both sides saw."""
    written = {}
    for kind, layout, v1 in CASES:
        case = hc.make_case(cluster.master, kind, layout, v1=v1)
        case.fill(seed=len(written) + 1)
        keys = hc.keys_for(hc.case_id(kind, layout, v1))
        written[hc.case_id(kind, layout, v1)] = (case.write(keys), case.digests())
        case.backend.close()
    tp0 = hc.make_case(cluster.master, "mha", "page_first", tp_rank=0, tp_size=2)
    tp0.fill(seed=100)
    assert tp0.write(hc.keys_for("tp2"))
    mla_writer = hc.make_case(cluster.master, "mla", "page_first", tp_rank=0, tp_size=2)
    mla_writer.fill(seed=200)
    assert mla_writer.write(hc.keys_for("mla-tp2"))
    steps = [
        {"op": "read", "kind": k, "layout": lay, "v1": v1, "keys": hc.keys_for(hc.case_id(k, lay, v1))}
        for k, lay, v1 in CASES
    ]
    steps += [
        {
            "op": "write",
            "kind": "mha",
            "layout": "page_first",
            "tp_rank": 1,
            "tp_size": 2,
            "seed": 101,
            "keys": hc.keys_for("tp2"),
        },
        {
            "op": "write",
            "kind": "mla",
            "layout": "page_first",
            "tp_rank": 1,
            "tp_size": 2,
            "seed": 201,
            "keys": hc.keys_for("mla-tp2"),
        },
        {
            "op": "read",
            "kind": "mla",
            "layout": "page_first",
            "tp_rank": 1,
            "tp_size": 2,
            "keys": hc.keys_for("mla-tp2"),
        },
    ]
    results = run_worker(tmp_path_factory.mktemp("worker"), cluster.master, steps)
    yield {
        "written": written,
        "read": dict(zip([hc.case_id(*c) for c in CASES], results)),
        "tp0": tp0.digests(),
        "tp1_write": results[len(CASES)],
        "mla_writer": mla_writer.digests(),
        "mla_rank1_write": results[len(CASES) + 1],
        "mla_rank1_read": results[len(CASES) + 2],
    }
    tp0.backend.close()
    mla_writer.backend.close()


# ---- building it as SGLang does ---------------------------------------------------------------------------
def test_factory_builds_backend_from_user_json(cluster):
    case = hc.make_case(cluster.master, "mha", "page_first")
    try:
        assert type(case.backend) is KVPluginsHiCacheStorage
        assert case.backend.config.store.master == cluster.master and case.backend.interface_v1
        assert case.controller.page_set_func == case.controller._page_set_zero_copy
    finally:
        case.backend.close()


def test_unknown_extra_config_key_lists_valid_keys():
    sc = hc.storage_config("127.0.0.1:1", mastr="typo")
    with pytest.raises(ConfigError, match="extra-config: unknown key.*mastr.*valid keys: .*store.*interface_v1"):
        KVPluginsHiCacheStorage(sc, {})


def test_config_precedence_extra_config_over_env_over_file(tmp_path, monkeypatch):
    cfg_file = tmp_path / "kvp.toml"
    cfg_file.write_text("[sglang]\nretry_ms = 333\n[sglang.store]\nrpc_timeout_ms = 111\ntransfer_timeout_ms = 222\n")
    monkeypatch.setenv("KVPLUGINS_CONFIG", str(cfg_file))
    monkeypatch.setenv("KVPLUGINS_CLIENT_TRANSFER_TIMEOUT_MS", "444")
    monkeypatch.setenv("KVPLUGINS_SGLANG_RETRY_MS", "555")
    backend = KVPluginsHiCacheStorage(hc.storage_config("127.0.0.1:1", retry_ms=666), {})
    cfg = backend.config
    assert (cfg.store.rpc_timeout_ms, cfg.store.transfer_timeout_ms, cfg.retry_ms) == (111, 444, 666)


def test_construction_needs_no_store():
    backend = KVPluginsHiCacheStorage(hc.storage_config("127.0.0.1:1"), {})  # nothing listens on port 1
    assert backend.get_stats().prefetch_pgs == []


def test_method_signatures_match_installed_hicache_storage():
    names = [
        "batch_get_v1",
        "batch_set_v1",
        "get",
        "set",
        "batch_get",
        "batch_set",
        "exists",
        "batch_exists",
        "clear",
        "get_stats",
        "register_mem_pool_host",
        "on_host_pools_registered",
        "register_mem_host_pool_v2",
        "batch_exists_v2",
        "batch_get_v2",
        "batch_set_v2",
    ]
    for name in names:
        ours = inspect.signature(getattr(KVPluginsHiCacheStorage, name))
        theirs = inspect.signature(getattr(HiCacheStorage, name))
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.default) for p in theirs.parameters.values()
        ], name
    assert not inspect.isabstract(KVPluginsHiCacheStorage)


# ---- pages across processes -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,layout,v1", CASES, ids=[hc.case_id(*c) for c in CASES])
def test_other_process_reads_pages_bit_exact(shared, kind, layout, v1):
    ok, digests = shared["written"][hc.case_id(kind, layout, v1)]
    read = shared["read"][hc.case_id(kind, layout, v1)]
    assert ok
    assert read["loaded"] == hc.PAGES
    assert read["digests"] == digests


def test_tp2_ranks_keep_their_own_shards(shared, cluster):
    assert shared["tp1_write"]["ok"]
    assert shared["tp1_write"]["digests"] != shared["tp0"]  # different shards, same page keys
    for rank, expect in ((0, shared["tp0"]), (1, shared["tp1_write"]["digests"])):
        case = hc.make_case(cluster.master, "mha", "page_first", tp_rank=rank, tp_size=2)
        try:
            assert case.read(hc.keys_for("tp2")) == hc.PAGES
            assert case.digests() == expect
            stats = case.backend.get_stats()
            assert stats.prefetch_pgs == [hc.PAGES] and stats.kvplugins["hits"] == hc.PAGES
        finally:
            case.backend.close()


def test_mla_only_writer_rank_writes_and_every_rank_reads(shared):
    assert shared["mla_rank1_write"]["ok"]  # a no-op success on the non-writer
    assert shared["mla_rank1_read"]["loaded"] == hc.PAGES
    assert shared["mla_rank1_read"]["digests"] == shared["mla_writer"]  # the writer's bytes, not rank 1's


# ---- lookups and failures ---------------------------------------------------------------------------------
def test_batch_exists_counts_the_stored_prefix(cluster):
    case = hc.make_case(cluster.master, "mha", "page_first")
    try:
        keys = hc.keys_for("prefix", 5)
        assert case.backend.batch_exists(keys) == 0
        assert all(
            case.backend.batch_set_v1([k], case.host_indices(1, 2 + i)) == [True] for i, k in enumerate(keys) if i != 2
        )
        assert case.backend.batch_exists(keys) == 2
        assert case.backend.batch_exists(keys[3:]) == 2
        assert case.backend.exists(keys[3]) and not case.backend.exists(keys[2])
        assert case.backend.batch_exists([]) == 0
    finally:
        case.backend.close()


def test_kv_dtype_layout_and_model_are_in_the_key_namespace(cluster):
    """SGLang issue #33268: keys without the KV dtype collide across deployments. Ours never do."""
    keys = hc.keys_for("namespace", 3)
    writer = hc.make_case(cluster.master, "mha", "page_first")
    others = [
        hc.make_case(cluster.master, "mha", "page_first", pool_kw={"dtype": torch.float16}),
        hc.make_case(cluster.master, "mha", "layer_first"),
        hc.make_case(cluster.master, "mha", "page_first", model="other/model"),
        hc.make_case(cluster.master, "mha", "page_first", namespace="tenant-b"),
        hc.make_case(cluster.master, "mha", "page_first", pool_kw={"page_size": 8}),
    ]
    same = hc.make_case(cluster.master, "mha", "page_first")
    try:
        assert writer.write(keys)
        assert [o.backend.batch_exists(keys) for o in others] == [0] * len(others)
        assert same.backend.batch_exists(keys) == 3
    finally:
        for c in [writer, same, *others]:
            c.backend.close()


def test_set_skips_stored_pages_and_a_bad_batch_does_not_poison_the_next(cluster):
    case = hc.make_case(cluster.master, "mha", "layer_first")
    try:
        keys = hc.keys_for("skip", 3)
        assert case.backend.batch_set_v1(keys, case.host_indices(3)) == [True] * 3
        assert case.backend.batch_set_v1(keys, case.host_indices(3)) == [True] * 3
        assert case.backend._pages.stats["skipped_pages"] == 3
        assert case.backend.batch_set_v1(keys, case.host_indices(2)) == [False] * 3  # wrong length: no raise
        more = hc.keys_for("skip-more", 2)
        assert case.backend.batch_set_v1(more, case.host_indices(2)) == [True, True]
        with pytest.raises(ValueError, match="host_indices"):
            case.backend.batch_get_v1(more, case.host_indices(1))
        stats = case.backend.get_stats()
        assert stats.backup_pgs and stats.kvplugins["bytes_put"] > 0
    finally:
        case.backend.close()


def test_clear_removes_only_this_backends_pages(cluster):
    mine, other = (hc.make_case(cluster.master, "mha", "page_first", model=m) for m in ("clear/a", "clear/a"))
    try:
        a, b = hc.keys_for("clear-a", 2), hc.keys_for("clear-b", 2)
        assert mine.write(a) and other.write(b)
        mine.backend.clear()
        assert mine.backend.batch_exists(a) == 0 and mine.backend.batch_exists(b) == 2
    finally:
        mine.backend.close()
        other.backend.close()


def test_store_down_reads_are_misses_and_writes_report_false(tmp_path):
    with store_cluster(nodes=1, segment_size="16MiB", tmp=tmp_path) as c:
        case = hc.make_case(c.master, "mha", "page_first")
        keys = hc.keys_for("down", 3)
        assert case.write(keys) and case.read(keys) == 3
        c.nodes[0].kill()
        c.master_proc.kill()
        try:
            assert case.read(keys) == 0  # controller: 0 pages, no exception
            assert case.backend.batch_get_v1(keys, case.host_indices(3)) == [False] * 3
            assert case.backend.batch_exists(keys) == 0 and not case.backend.exists(keys[0])
            assert case.backend.batch_set_v1(keys, case.host_indices(3)) == [False] * 3
            assert case.controller._page_set_zero_copy(keys, case.host_indices(3)) is False
            assert case.backend.batch_get(keys, None) == [None] * 3
            assert case.backend.batch_set(keys, [case.pool.get_data_page(0)] * 3) is False
        finally:
            case.backend.close()


def test_attach_with_store_down_then_serves_once_it_is_up(tmp_path):
    with socket.socket() as sock:  # a port nothing listens on yet (the master takes it later)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    case = hc.make_case(f"127.0.0.1:{port}", "mha", "page_first")  # retry_ms=200
    keys = hc.keys_for("late", 2)
    try:
        assert case.read(keys) == 0 and not case.write(keys)
        with store_cluster(nodes=1, segment_size="16MiB", master_flags={"port": port}, tmp=tmp_path):
            deadline = time.monotonic() + 10
            while not case.write(keys) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert case.backend.batch_exists(keys) == 2 and case.read(keys) == 2
    finally:
        case.backend.close()


def test_node_lost_then_replaced_failed_batches_do_not_poison_later_ones(tmp_path):
    with store_cluster(nodes=1, segment_size="16MiB", master_flags={"heartbeat_timeout_ms": 500}, tmp=tmp_path) as c:
        case = hc.make_case(c.master, "mha", "page_head")
        try:
            assert case.write(hc.keys_for("before", 2))
            c.nodes[0].kill()
            assert case.backend.batch_set_v1(hc.keys_for("lost", 2), case.host_indices(2)) == [False, False]
            assert case.read(hc.keys_for("before", 2)) == 0  # its only replica is gone
            c.add_node("16MiB")
            deadline = time.monotonic() + 10
            while not case.write(hc.keys_for("after", 2)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert case.read(hc.keys_for("after", 2)) == 2
        finally:
            case.backend.close()


def test_prefetch_and_backup_threads_share_one_backend(cluster):
    """SGLang's prefetch and backup threads call one backend concurrently; every page must still be exact."""
    case = hc.make_case(cluster.master, "mha", "layer_first")
    reader = hc.make_case(cluster.master, "mha", "layer_first")
    case.fill(seed=7)
    expect = case.digests(hc.PAGES)
    errors: list = []

    def backup(i):
        keys = hc.keys_for(f"threads-{i}")
        assert case.backend.batch_set_v1(keys, case.host_indices()) == [True] * hc.PAGES

    def prefetch(i):
        keys = hc.keys_for(f"threads-{i}")
        assert case.backend.batch_get_v1(keys, case.host_indices()) == [True] * hc.PAGES

    def run(fn, rounds):
        try:
            for i in rounds:
                fn(i)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    backup(0)
    threads = [
        threading.Thread(target=run, args=(backup, range(1, 30))),
        threading.Thread(target=run, args=(prefetch, [0] * 30)),
    ]  # reads page set 0 into the same pages
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads)
        assert case.digests(hc.PAGES) == expect  # reads wrote back the same bytes
        assert reader.read(hc.keys_for("threads-29")) == hc.PAGES and reader.digests() == expect
    finally:
        case.backend.close()
        reader.backend.close()


def test_no_master_key_uses_the_embedded_store(tmp_path, monkeypatch):
    """The single-host flags (no "master"): the backend finds the running `kvplugins up` by its discovery file."""
    with up_process(segment_size="16MiB", tmp=tmp_path) as up:
        monkeypatch.setenv("KVPLUGINS_UP_DISCOVERY_FILE", str(up.discovery_file))
        case = hc.make_case(None, "mla", "layer_first")
        try:
            assert case.write(hc.keys_for("embedded", 2)) and case.read(hc.keys_for("embedded", 2)) == 2
            assert case.backend.get_stats().kvplugins["master"] == up.address
        finally:
            case.backend.close()
