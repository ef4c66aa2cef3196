"""Storage interface v2 (hybrid models) inside SGLang 0.5.23's own types, on CPU, against real store processes:
this process writes a prompt's KV pages (v1) and its side pool's trailing pages (v2: the SWA window, or the
Mamba state at the last page) from real host pools; another process (hicache_worker.py "v2read") asks
``batch_exists_v2`` with the TRAILING_PAGES policy, then reads both back bit-exact into zeroed pools.
Not covered: SGLang's HybridCacheController itself (it needs a GPU allocator and process groups), so the
transfers are built the way it builds them (hicache_v2_case.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang not installed: bash ci/install-sglang.sh")

import hicache_case as hc  # noqa: E402
import hicache_v2_case as v2  # noqa: E402
from helpers.cluster import store_cluster  # noqa: E402

WORKER = Path(__file__).with_name("hicache_worker.py")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with store_cluster(nodes=1, segment_size="64MiB", tmp=tmp_path_factory.mktemp("store")) as c:
        yield c


@pytest.mark.parametrize("side", ["swa", "mamba"])
def test_other_process_reads_kv_and_side_pool_bit_exact(cluster, tmp_path, side):
    keys = hc.keys_for(f"v2-{side}", v2.PAGES)
    backend, kv, pool = v2.make(cluster.master, side)
    v2.fill(kv, 1)
    v2.fill(pool, 2)
    t = v2.side_transfer(side, keys)
    assert backend.batch_set_v2([t]) == {side: [True] * len(t.keys)}
    assert backend.batch_set_v1(keys, v2.kv_indices()) == [True] * v2.PAGES  # same hashes, other pool: no clash
    want_kv = v2.digests(kv, v2.kv_indices(), 4)
    want_side = v2.digests(pool, t.host_indices, 4 if side == "swa" else 1)
    backend.close()
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"master": cluster.master, "steps": [{"op": "v2read", "side": side, "keys": keys}]}))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(job), str(out)], capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())[0]
    assert got["hit"] == v2.PAGES and got["restorable"] == [v2.PAGES]  # only the end where the side pages are
    assert got["pools"] == {"kv": v2.PAGES, side: v2.PAGES}
    assert got["short_hit"] == 0  # the first 4 pages are all stored as KV, but no window/state ends there
    assert got["side_ok"] == [True] * len(t.keys) and got["kv_ok"] == [True] * v2.PAGES
    assert got["kv"] == want_kv and got["side"] == want_side and len(set(want_side)) == len(want_side)


def test_hit_policies_follow_sglang():
    from kvplugins.sglang_hicache_backend.pools_v2 import allowed_lengths, combine

    stored = [True, False, True, True, False, True]
    assert allowed_lengths("all_pages", 0, stored) == {1}
    assert allowed_lengths("trailing_pages", 2, stored) == {1, 4}  # [max(0, p-2), p) all stored
    assert allowed_lengths("trailing_pages", 1, stored) == {1, 3, 4, 6}
    assert combine(6, {"swa": {1, 4}, "mamba": {1, 3, 4, 6}}) == (4, {"swa": 4, "mamba": 6}, [1, 4])
    with pytest.raises(ValueError, match="block_groups"):
        allowed_lengths("block_groups", 2, stored)
