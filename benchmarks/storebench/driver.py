"""Runs every case against one running store: a writer process puts, a different reader process gets, the
driver compares their per-object checksums, then the reader removes the keys. Only the store call is timed."""
from __future__ import annotations

import json
import os
from pathlib import Path

from storebench.clusters import Target
from storebench.procs import Worker
from storebench.report import summarize
from storebench.workload import Case


class BytesMismatch(RuntimeError):
    """A reader's checksum differs from the writer's: the store returned wrong bytes."""


def run_target(target: Target, cases: list[Case], log_dir: Path, timeout_s: float) -> tuple[list[dict], dict]:
    """All cases on ``target``; returns (rows, {"writer": stats, "reader": stats})."""
    live = [c for c in cases if not c.skipped]
    buffer_bytes = max(c.batch_bytes for c in live)
    common = ["--backend", target.backend, "--config", json.dumps(target.cfg), "--buffer-bytes", str(buffer_bytes)]
    workers = {}
    try:
        for role in ("writer", "reader"):
            workers[role] = Worker(f"{target.label}-{role}", [*common, "--role", role], target.env, log_dir, timeout_s)
        rows = []
        for case in cases:
            rows += _skipped_rows(target, case) if case.skipped else run_case(target, case, **workers)
        stats = {role: w.call({"op": "stats"})["stats"] for role, w in workers.items()}
        return rows, stats
    finally:
        for w in workers.values():
            w.close()


def run_case(target: Target, case: Case, writer: Worker, reader: Worker) -> list[dict]:
    times = {"put": [], "get": []}
    prefix = f"sb-{os.getpid()}-{target.label}-{case.name}"
    for r in range(case.warmup + case.iters):
        keys = [f"{prefix}-{r}-{j}" for j in range(case.batch)]
        put = writer.call({"op": "put", "keys": keys, "size": case.size, "round": r})
        get = reader.call({"op": "get", "keys": keys, "size": case.size})
        if get["sums"] != put["sums"]:
            bad = [k for k, a, b in zip(keys, put["sums"], get["sums"]) if a != b]
            raise BytesMismatch(f"{target.label} {case.name}: reader got wrong bytes for {len(bad)} of "
                                f"{len(keys)} objects, first {bad[0]!r}")
        reader.call({"op": "remove", "keys": keys})
        if r >= case.warmup:
            times["put"].append(put["t"])
            times["get"].append(get["t"])
    verified = (case.warmup + case.iters) * case.batch
    return [_row(target, case, op, ts, verified) for op, ts in times.items()]


def _row(target: Target, case: Case, op: str, seconds: list[float], verified: int) -> dict:
    return {**_key(target, case, op), "iters": len(seconds), "warmup": case.warmup,
            **summarize(seconds, case.batch, case.batch_bytes),
            "verified_objects": verified, "verified_bytes": verified * case.size, "skipped": ""}


def _skipped_rows(target: Target, case: Case) -> list[dict]:
    return [{**_key(target, case, op), "skipped": case.skipped} for op in ("put", "get")]


def _key(target: Target, case: Case, op: str) -> dict:
    return {"target": target.label, "store": target.store, "mode": target.mode, "op": op,
            "size": case.size, "batch": case.batch, "case": case.name, "batch_bytes": case.batch_bytes}
