"""SGLang 0.5.23's own ``mooncake`` HiCache backend (issue #19) on our store: ``kvplugins mooncake enable`` (into a
throw-away site dir) makes its ``from mooncake.store import MooncakeDistributedStore`` our compat client; its
MooncakeStore, attached to a real CPU host pool, writes pages with the controller's zero-copy page IO in one
process and a second process reads them back bit-exact. The shim's CLI refuses to shadow the real Mooncake wheel
this venv has (the benchmark anchor) unless forced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang not installed: bash ci/install-sglang.sh")

from helpers.cluster import store_cluster  # noqa: E402
from kvplugins.cli import main as cli_main  # noqa: E402
from kvplugins.mooncake import shim as mooncake_shim  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hicache_case as hc  # noqa: E402

WORKER = Path(__file__).with_name("hicache_worker.py")
PROBE = (
    "import site, sys; site.addsitedir(sys.argv[1]); import mooncake.store as m; "
    "print(m.MooncakeDistributedStore.__module__)"
)


def which_mooncake(site_dir) -> str:
    r = subprocess.run([sys.executable, "-c", PROBE, str(site_dir)], capture_output=True, text=True, timeout=60)
    return r.stdout.strip() if r.returncode == 0 else f"error: {r.stderr.strip().splitlines()[-1]}"


def run_worker(tmp_path: Path, site_dir: Path, master: str, steps: list[dict]) -> list[dict]:
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"master": master, "steps": steps}))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(job), str(out)],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "KVP_TEST_SITE": str(site_dir)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_enable_refuses_to_shadow_a_real_mooncake_unless_forced(tmp_path, capsys):
    real = mooncake_shim.SHIM.real(tmp_path)
    if real is None:
        pytest.skip("no real Mooncake in this venv to shadow (benchmarks/install_mooncake.sh installs it)")
    before = which_mooncake(tmp_path)
    assert cli_main(["mooncake", "enable", "--site-dir", str(tmp_path)]) == 2
    assert "real mooncake-transfer-engine is installed" in capsys.readouterr().err
    assert which_mooncake(tmp_path) == before  # untouched
    assert cli_main(["mooncake", "enable", "--force", "--site-dir", str(tmp_path)]) == 0
    assert "shadowing" in capsys.readouterr().out
    assert which_mooncake(tmp_path) == "kvplugins.mooncake.api"
    assert cli_main(["mooncake", "status", "--site-dir", str(tmp_path)]) == 0
    assert "enabled" in capsys.readouterr().out
    assert cli_main(["mooncake", "disable", "--site-dir", str(tmp_path)]) == 0
    assert which_mooncake(tmp_path) == before and not mooncake_shim.status(tmp_path).enabled


CASES = [("mha", "page_first"), ("mha", "page_first_direct"), ("mla", "page_first"), ("mla", "layer_first")]
# SGLang refuses mooncake + MHA layer_first. All four cases run in one writer and one reader process (each
# process imports SGLang once: ~8 s on 2 CPUs).


def test_sglang_mooncake_backend_on_our_store_reads_back_bit_exact(tmp_path):
    site_dir = tmp_path / "site"
    mooncake_shim.enable(site_dir, force=True)
    keys = {case: hc.keys_for(f"mooncake-{case[0]}-{case[1]}") for case in CASES}
    writes = [
        {"op": "write", "backend": "mooncake", "kind": k, "layout": lay, "keys": keys[k, lay], "seed": 7}
        for k, lay in CASES
    ]
    reads = [{"op": "read", "backend": "mooncake", "kind": k, "layout": lay, "keys": keys[k, lay]} for k, lay in CASES]
    with store_cluster(nodes=1, segment_size="256MiB", tmp=tmp_path / "store") as c:  # the four cases' pages
        written = run_worker(tmp_path, site_dir, c.master, writes)
        read = run_worker(tmp_path, site_dir, c.master, reads)
    for case, w, r in zip(CASES, written, read):
        assert w["store"] == r["store"] == "kvplugins.mooncake.api", case  # SGLang's import got our client
        assert w["ok"] and r["loaded"] == len(keys[case]), case
        assert r["digests"] == w["digests"], case
