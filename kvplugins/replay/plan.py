"""What one ``kvplugins replay`` run does: load (or generate) the trace, size objects, build the configurations
(one, or three per capacity with ``--sweep``), replay each against a store, and report."""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass

from kvplugins.config import format_bytes, load
from kvplugins.errors import ConfigError
from kvplugins.replay import report, shapes, synth, trace
from kvplugins.replay.caches import reference_hit_ratio
from kvplugins.replay.config import ReplayConfig, capacity_blocks
from kvplugins.replay.pool import PoolOps, private_store
from kvplugins.replay.runner import Plan, replay
from kvplugins.store import ClientConfig, StoreClient

log = logging.getLogger(__name__)

AUTO_OBJECT_BYTES = 4096


@dataclass(frozen=True)
class Sizes:
    """Full-scale bytes of one block, the divisor, and the bytes of each stored object (a multiple of 64)."""

    block_bytes: int
    scale: int
    object_bytes: int


def sizes(cfg: ReplayConfig) -> Sizes:
    shape = shapes.resolve(cfg.model_shape, cfg.layers, cfg.kv_heads, cfg.head_dim, cfg.kv_dtype)
    full = shape.block_bytes(cfg.block_tokens)
    scale = cfg.scale or max(1, full // AUTO_OBJECT_BYTES)
    return Sizes(full, scale, max(64, math.ceil(full / scale / 64) * 64))


def plans(cfg: ReplayConfig, block_bytes: int) -> list[Plan]:
    """The configurations to replay. Without --sweep: the one the flags describe. With it, per capacity C:
    "global pool" (C, no local caches), "N local caches" (C / N each, no pool) and, with --local-capacity,
    "both tiers" (that local capacity in front of a pool of C)."""
    local = capacity_blocks(cfg.local_capacity, block_bytes, "--local-capacity")
    speed = cfg.speed if cfg.realtime else 0.0
    common = dict(
        instances=cfg.instances,
        routing=cfg.routing,
        block_tokens=cfg.block_tokens,
        speed=speed,
        miss_on_store_error=cfg.miss_on_store_error,
        prefill_tok_s=0.0 if cfg.realtime else cfg.prefill_tok_s,
        load_bytes_s=cfg.load_gbps * 1e9,
        block_bytes=block_bytes,
        slo_ms=cfg.slo_ttft_ms,
        clock=cfg.speed,
    )
    if not cfg.sweep:
        pool = 0 if cfg.no_pool else capacity_blocks(cfg.pool_capacity, block_bytes, "--pool-capacity")
        label = "both tiers" if pool and local else "global pool" if pool else f"{cfg.instances} local caches"
        return [Plan(label, pool, local, **common)]
    if cfg.master:
        raise ConfigError("--sweep sizes a private store per capacity; it cannot resize the store at --master")
    out = []
    for text in cfg.sweep.split(","):
        c = capacity_blocks(text, block_bytes, "--sweep capacity")
        if c < 1:
            raise ConfigError(f"--sweep capacity {text!r} is under one block")
        out.append(Plan("global pool", c, 0, **common))
        out.append(Plan(f"{cfg.instances} local caches", 0, max(1, c // cfg.instances), **common))
        if local:
            out.append(Plan(f"both tiers ({local} local/instance)", c, local, **common))
    return out


def requests_of(cfg: ReplayConfig, path: str | None) -> list:
    if cfg.synth:
        reqs = synth.generate(cfg)
        if cfg.synth_out:
            trace.write(cfg.synth_out, reqs)
        return reqs[: cfg.limit] if cfg.limit else reqs
    if not path:
        raise ConfigError("give a trace file (FAST'25 or kvplugins JSONL), or --synth to generate one")
    return trace.load(path, cfg.limit)


def dry_run(cfg: ReplayConfig, reqs: list, sz: Sizes, todo: list[Plan]) -> str:
    blocks = sum(len(r.blocks) for r in reqs)
    unique = len({b for r in reqs for b in r.blocks})
    lines = [
        f"{len(reqs):,} requests, {blocks:,} block lookups, {unique:,} distinct blocks; block = "
        f"{format_bytes(sz.block_bytes)} at full scale, stored as {sz.object_bytes} B (scale 1/{sz.scale})"
    ]
    for p in todo:
        pool = p.pool_blocks * sz.object_bytes
        local = p.local_blocks * p.instances
        lines.append(
            f"  {p.label}: pool {p.pool_blocks:,} blocks = {format_bytes(p.pool_blocks * sz.block_bytes)} "
            f"full scale, a {format_bytes(pool)} segment here; local {local:,} blocks in all"
            + ("" if not p.pool_blocks or cfg.master else f"; peak memory here ~{format_bytes(2 * pool)}")
        )
    return "\n".join(lines)


def execute(cfg: ReplayConfig, path: str | None, say=print, make_client=None) -> list[dict]:
    """Run everything; returns the result rows (report.row). ``say`` gets the table and progress lines.
    ``make_client(master)``: the pool's client of ``cfg.master`` for one engine instance (batch_exists_prefix,
    batch_get answering bytes or a KVPluginsError per key, batch_put, close); default a StoreClient. The cluster
    runs pass Mooncake's (tests/cluster/mooncake_side.py), so the same trace meets both stores."""
    reqs = requests_of(cfg, path)
    if not reqs:
        raise ConfigError("the trace holds no requests")
    sz = sizes(cfg)
    todo = plans(cfg, sz.block_bytes)
    if cfg.dry_run:
        say(dry_run(cfg, reqs, sz, todo))
        return []
    rows = []
    for p in todo:
        res = _one(cfg, p, reqs, sz, make_client)
        ref = None
        if not p.local_blocks and not p.speed:
            ref = reference_hit_ratio(reqs, p.pool_blocks)
        elif not p.pool_blocks and p.routing == "round_robin":
            ref = reference_hit_ratio(reqs, p.local_blocks * p.instances, p.instances)
        rows.append(report.row(res, sz.block_bytes, ref, cfg.prefill_tok_s))
    say(report.table(rows))
    meta = {
        "trace": os.path.basename(path) if path else "synthetic",
        "requests": len(reqs),
        "block_bytes": sz.block_bytes,
        "object_bytes": sz.object_bytes,
        "scale": sz.scale,
        "model_shape": cfg.model_shape,
    }
    if cfg.json:
        report.write_json(rows, meta, cfg.json)
        if cfg.json != "-":
            log.info("results as JSON: %s", os.path.abspath(cfg.json))
    if cfg.plot:
        report.plot(
            rows,
            sz.block_bytes,
            cfg.plot,
            f"{meta['trace']}: {len(reqs):,} requests, {cfg.model_shape} blocks of {cfg.block_tokens} tokens",
        )
        log.info("plot of hit ratio vs capacity: %s", os.path.abspath(cfg.plot))
    return rows


def _one(cfg: ReplayConfig, p: Plan, reqs: list, sz: Sizes, make_client=None):
    bar = _progress(cfg, p, len(reqs))
    try:

        def run(master: str):
            def make_pool(ns: str):
                if make_client is not None:
                    client = make_client(master)
                else:
                    client = StoreClient(load(ClientConfig, {"master": master, "slab_bytes": 0}))
                return PoolOps(client, ns, sz.object_bytes, timed=bool(p.speed))

            return replay(reqs, p, make_pool, bar[1] if bar else None)

        if not p.pool_blocks:
            return replay(reqs, p, lambda ns: None, bar[1] if bar else None)
        if cfg.master:
            return run(cfg.master)
        with private_store(p.pool_blocks * sz.object_bytes, grace_ms=-1 if p.speed else 0) as master:
            return run(master)
    finally:
        if bar:
            bar[0].stop()


def _progress(cfg: ReplayConfig, p: Plan, total: int):
    """(progress, advance) on stderr when --progress and stderr is a terminal; else None."""
    if not cfg.progress or not sys.stderr.isatty():
        return None
    from rich.console import Console
    from rich.progress import Progress

    prog = Progress(console=Console(stderr=True), transient=True)
    task = prog.add_task(f"{p.label}, pool {p.pool_blocks}", total=total)
    prog.start()
    return prog, lambda n: prog.advance(task, n)
