"""Another SGLang rank in its own process (run by test_hicache.py): ``python hicache_worker.py JOB.json OUT.json``.

JOB: {"master": addr, "steps": [{"op": "read"|"write", "kind", "layout", "v1", "tp_rank", "tp_size",
"keys", "seed"}]}. A write fills the pool from ``seed`` and writes the pages; a read loads them into a zeroed
pool. OUT: one {"ok"/"loaded", "digests"} per step (sha256 of every page's bytes after the step).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_cpu  # noqa: E402

sglang_cpu.install()
import hicache_case  # noqa: E402


def run(step: dict, master: str) -> dict:
    case = hicache_case.make_case(master, step["kind"], step["layout"], v1=step.get("v1", True),
                                  tp_rank=step.get("tp_rank", 0), tp_size=step.get("tp_size", 1))
    try:
        if step["op"] == "write":
            case.fill(step["seed"])
            return {"ok": bool(case.write(step["keys"])), "digests": case.digests(len(step["keys"]))}
        return {"loaded": case.read(step["keys"]), "digests": case.digests(len(step["keys"]))}
    finally:
        case.backend.close()


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    out = [run(step, job["master"]) for step in job["steps"]]
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
