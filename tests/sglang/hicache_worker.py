"""Another SGLang rank in its own process (run by test_hicache.py): ``python hicache_worker.py JOB.json OUT.json``.

JOB: {"master": addr, "steps": [{"op": "read"|"write", "kind", "layout", "v1", "tp_rank", "tp_size",
"keys", "seed"}]}. A write fills the pool from ``seed`` and writes the pages; a read loads them into a zeroed
pool. OUT: one {"ok"/"loaded", "digests"} per step (sha256 of every page's bytes after the step).
Op "v2read" ({"side": "swa"|"mamba", "keys"}): a hybrid pool set (hicache_v2_case.py) asks batch_exists_v2 for
the whole prompt and for its first 4 pages, then reads KV (v1) and the side pool (v2) into zeroed pools.
"""

from __future__ import annotations

import json
import os
import site
import sys
from pathlib import Path

if os.environ.get("KVP_TEST_SITE"):  # a site dir holding a shim (`kvplugins mooncake enable --site-dir`)
    site.addsitedir(os.environ["KVP_TEST_SITE"])
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_cpu  # noqa: E402

sglang_cpu.install()
import hicache_case  # noqa: E402


def run(step: dict, master: str) -> dict:
    if step["op"] == "v2read":
        return read_v2(step, master)
    if step.get("backend") == "mooncake":
        import mooncake.store

        case = hicache_case.make_mooncake_case(master, step["kind"], step["layout"])
        step_store = mooncake.store.MooncakeDistributedStore.__module__
    else:
        case = hicache_case.make_case(
            master,
            step["kind"],
            step["layout"],
            v1=step.get("v1", True),
            tp_rank=step.get("tp_rank", 0),
            tp_size=step.get("tp_size", 1),
        )
        step_store = "kvplugins"
    try:
        if step["op"] == "write":
            case.fill(step["seed"])
            return {
                "ok": bool(case.write(step["keys"])),
                "digests": case.digests(len(step["keys"])),
                "store": step_store,
            }
        return {"loaded": case.read(step["keys"]), "digests": case.digests(len(step["keys"])), "store": step_store}
    finally:
        case.backend.close()


def read_v2(step: dict, master: str) -> dict:
    import hicache_v2_case as v2

    side, keys = step["side"], step["keys"]
    backend, kv, pool = v2.make(master, side)
    try:
        query = v2.side_transfer(side, keys, placeholder=True)
        whole = backend.batch_exists_v2(keys, [query])
        short = backend.batch_exists_v2(keys[:4], [query])
        t = v2.side_transfer(side, keys)
        side_ok = backend.batch_get_v2([t])[side]
        kv_ok = backend.batch_get_v1(keys, v2.kv_indices())
        step_side = 4 if side == "swa" else 1
        return {
            "hit": whole.kv_hit_pages,
            "restorable": whole.restorable_prefix_pages,
            "pools": whole.extra_pool_hit_pages,
            "short_hit": short.kv_hit_pages,
            "side_ok": side_ok,
            "kv_ok": kv_ok,
            "kv": v2.digests(kv, v2.kv_indices(), 4),
            "side": v2.digests(pool, t.host_indices, step_side),
        }
    finally:
        backend.close()


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    out = [run(step, job["master"]) for step in job["steps"]]
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
