"""Runs every case against one running store: a writer process puts, a different reader process gets, the
driver compares their per-object checksums, then the reader removes the keys. Only the store call is timed."""
from __future__ import annotations

import json
import os
import time
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
        gate = SpaceGate(target)
        _prefault(target, max(live, key=lambda c: c.batch_bytes), gate, **workers)
        rows = []
        for case in cases:
            rows += _skipped_rows(target, case) if case.skipped else run_case(target, case, gate, **workers)
        stats = {role: w.call({"op": "stats"})["stats"] for role, w in workers.items()}
        return rows, stats
    finally:
        for w in workers.values():
            w.close()


class SpaceGate:
    """Keeps puts from meeting a segment full of removed-but-leased objects ("zombies": a removed object's space
    returns when the lease its get took ends). Before a put, waits (untimed) until the zombies still leased plus
    the new batch fit in 3/4 of the segment. A no-op for stores whose removals free at once (lease_ms 0)."""

    def __init__(self, target: Target):
        self.budget, self.lease_s = target.segment_bytes * 3 // 4, target.lease_ms / 1000 + 0.05
        self.zombies: list[tuple[float, int]] = []     # (free at, bytes)

    def wait_for(self, nbytes: int) -> None:
        while True:
            now = time.monotonic()
            self.zombies = [z for z in self.zombies if z[0] > now]
            if not self.zombies or sum(n for _, n in self.zombies) + nbytes <= self.budget:
                return
            time.sleep(min(z[0] for z in self.zombies) - now)

    def removed(self, leased_at: float, nbytes: int) -> None:
        if self.lease_s > 0.05:
            self.zombies.append((leased_at + self.lease_s, nbytes))


def run_case(target: Target, case: Case, gate: SpaceGate, writer: Worker, reader: Worker) -> list[dict]:
    times = {"put": [], "get": []}
    for r in range(case.warmup + case.iters):
        put_s, get_s = _round(target, case, r, gate, writer, reader)
        if r >= case.warmup:
            times["put"].append(put_s)
            times["get"].append(get_s)
    verified = (case.warmup + case.iters) * case.batch
    return [_row(target, case, op, ts, verified) for op, ts in times.items()]


def _round(target: Target, case: Case, r: int, gate: SpaceGate, writer: Worker, reader: Worker,
           tag: str = "") -> tuple[float, float]:
    """Writer puts a batch, reader gets it, checksums must match, reader removes it. Returns (put_s, get_s)."""
    keys = [f"sb-{os.getpid()}-{target.label}-{case.name}{tag}-{r}-{j}" for j in range(case.batch)]
    gate.wait_for(case.batch_bytes)
    put = writer.call({"op": "put", "keys": keys, "size": case.size, "round": r})
    leased_at = time.monotonic()
    get = reader.call({"op": "get", "keys": keys, "size": case.size})
    if get["sums"] != put["sums"]:
        bad = [k for k, a, b in zip(keys, put["sums"], get["sums"]) if a != b]
        raise BytesMismatch(f"{target.label} {case.name}: reader got wrong bytes for {len(bad)} of "
                            f"{len(keys)} objects, first {bad[0]!r}")
    reader.call({"op": "remove", "keys": keys})
    gate.removed(leased_at, case.batch_bytes)
    return put["t"], get["t"]


def _prefault(target: Target, case: Case, gate: SpaceGate, writer: Worker, reader: Worker) -> None:
    """Untimed (verified) rounds of the largest case until the segment's size has been written once, so no timed
    op pays for the first touch of segment pages (memfd/tmpfs pages are allocated and mapped on first write, in
    every process that maps them). A store that is in use is in this state."""
    for r in range(-(-target.segment_bytes // case.batch_bytes) + 1):
        _round(target, case, r, gate, writer, reader, tag="-prefault")


def _row(target: Target, case: Case, op: str, seconds: list[float], verified: int) -> dict:
    return {**_key(target, case, op), "iters": len(seconds), "warmup": case.warmup,
            **summarize(seconds, case.batch, case.batch_bytes),
            "verified_objects": verified, "verified_bytes": verified * case.size, "skipped": ""}


def _skipped_rows(target: Target, case: Case) -> list[dict]:
    return [{**_key(target, case, op), "skipped": case.skipped} for op in ("put", "get")]


def _key(target: Target, case: Case, op: str) -> dict:
    return {"target": target.label, "store": target.store, "mode": target.mode, "op": op,
            "size": case.size, "batch": case.batch, "case": case.name, "batch_bytes": case.batch_bytes}
