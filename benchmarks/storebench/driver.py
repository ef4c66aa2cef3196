"""Runs the cases against running stores: per store a writer process puts, a different reader process gets, the
driver compares their per-object checksums, then the reader removes the keys. Only the store call is timed.

Several stores can run interleaved (case by case: store A, B, C, then the next case), so a change of machine
load during the run hits every store alike and the ratios stay fair on a noisy machine."""

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


class SpaceGate:
    """Keeps puts from meeting a segment full of removed-but-leased objects ("zombies": a removed object's space
    returns when the lease its get took ends). Before a put, waits (untimed) until the zombies still leased plus
    the new batch fit in 3/4 of the segment. A no-op for stores whose removals free at once (lease_ms 0)."""

    def __init__(self, target: Target):
        self.budget, self.lease_s = target.segment_bytes * 3 // 4, target.lease_ms / 1000 + 0.05
        self.zombies: list[tuple[float, int]] = []  # (free at, bytes)

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


class Session:
    """One store's writer and reader workers. ``run_case`` returns its put and get rows."""

    def __init__(self, target: Target, buffer_bytes: int, log_dir: Path, timeout_s: float):
        self.target, self.gate, self.workers = target, SpaceGate(target), {}
        args = ["--backend", target.backend, "--config", json.dumps(target.cfg), "--buffer-bytes", str(buffer_bytes)]
        try:
            for role in ("writer", "reader"):
                self.workers[role] = Worker(
                    f"{target.label}-{role}", [*args, "--role", role], target.env, log_dir, timeout_s
                )
        except BaseException:
            self.close()
            raise

    def prefault(self, case: Case) -> None:
        """Untimed (verified) rounds of ``case`` until the segment's size has been written once, so no timed op
        pays for the first touch of segment pages (memfd/tmpfs pages are allocated and mapped on first write, in
        every process that maps them). A store in use is in this state."""
        for r in range(-(-self.target.segment_bytes // case.batch_bytes) + 1):
            self._round(case, r, tag="-prefault")

    def run_case(self, case: Case) -> list[dict]:
        if case.skipped:
            return [{**self._key(case, op), "skipped": case.skipped} for op in ("put", "get")]
        times = {"put": [], "get": []}
        for r in range(case.warmup + case.iters):
            put_s, get_s = self._round(case, r)
            if r >= case.warmup:
                times["put"].append(put_s)
                times["get"].append(get_s)
        verified = (case.warmup + case.iters) * case.batch
        return [
            {
                **self._key(case, op),
                "iters": len(ts),
                "warmup": case.warmup,
                **summarize(ts, case.batch, case.batch_bytes),
                "verified_objects": verified,
                "verified_bytes": verified * case.size,
                "skipped": "",
            }
            for op, ts in times.items()
        ]

    def _round(self, case: Case, r: int, tag: str = "") -> tuple[float, float]:
        """Writer puts a batch, reader gets it, checksums must match, reader removes it. Returns (put_s, get_s)."""
        writer, reader = self.workers["writer"], self.workers["reader"]
        keys = [f"sb-{os.getpid()}-{self.target.label}-{case.name}{tag}-{r}-{j}" for j in range(case.batch)]
        self.gate.wait_for(case.batch_bytes)
        put = writer.call({"op": "put", "keys": keys, "size": case.size, "round": r})
        get = reader.call({"op": "get", "keys": keys, "size": case.size})
        leased_at = time.monotonic()  # every lease the get took (a re-read takes a new one) began before its reply
        if get["sums"] != put["sums"]:
            bad = [k for k, a, b in zip(keys, put["sums"], get["sums"]) if a != b]
            raise BytesMismatch(
                f"{self.target.label} {case.name}: reader got wrong bytes for {len(bad)} of "
                f"{len(keys)} objects, first {bad[0]!r}"
            )
        reader.call({"op": "remove", "keys": keys})
        self.gate.removed(leased_at, case.batch_bytes)
        return put["t"], get["t"]

    def _key(self, case: Case, op: str) -> dict:
        t = self.target
        return {
            "target": t.label,
            "store": t.store,
            "mode": t.mode,
            "op": op,
            "size": case.size,
            "batch": case.batch,
            "case": case.name,
            "batch_bytes": case.batch_bytes,
        }

    def stats(self) -> dict:
        return {role: w.call({"op": "stats"})["stats"] for role, w in self.workers.items()}

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
