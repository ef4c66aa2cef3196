"""What is measured: cases (object size x batch), how many iterations each gets, and byte verification.

Objects of a batch lie back to back in one registered buffer (object j at offset j*size). The writer's buffer
holds random bytes; before each put the writer stamps every object with (iteration, index) at both ends, so a
reader that got a stale or partial object sees a different xxh3-64 checksum. The reader zeroes its buffer
before each get.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = (4 * KiB, 64 * KiB, MiB, 16 * MiB)
BATCHES = (1, 32, 128)
QUICK_SIZES = (4 * KiB, MiB)
QUICK_BATCHES = (1, 32)
_STAMP = struct.Struct("<QQ")


@dataclass(frozen=True)
class Case:
    """One row: ``batch`` objects of ``size`` bytes per put/get call; ``iters`` timed rounds after ``warmup``."""

    size: int
    batch: int
    iters: int = 0
    warmup: int = 0
    skipped: str = ""

    @property
    def batch_bytes(self) -> int:
        return self.size * self.batch

    @property
    def name(self) -> str:
        return f"{size_label(self.size)}x{self.batch}"


def size_label(n: int) -> str:
    return f"{n // MiB}MiB" if n >= MiB else f"{n // KiB}KiB"


def plan(
    sizes, batches, max_batch_bytes: int, bytes_per_case: int, min_iters: int, max_iters: int, warmup: int
) -> list[Case]:
    """Every size x batch; a case over ``max_batch_bytes`` is kept as skipped (with the reason) so the table shows it.
    Iterations: ``bytes_per_case / batch_bytes`` clamped to [min_iters, max_iters]."""
    cases = []
    for size in sizes:
        for batch in batches:
            nbytes = size * batch
            if nbytes > max_batch_bytes:
                why = f"{nbytes / MiB:g} MiB per batch > --max-batch-bytes {max_batch_bytes / MiB:g} MiB"
                cases.append(Case(size, batch, skipped=why))
                continue
            iters = min(max_iters, max(min_iters, math.ceil(bytes_per_case / nbytes)))
            cases.append(Case(size, batch, iters, warmup))
    return cases


def fill_random(buf: np.ndarray, seed: int) -> None:
    """Fill a uint8 buffer with reproducible random bytes (in 64 MiB chunks, to bound temporary memory)."""
    rng = np.random.default_rng(seed)
    step = 64 * MiB
    for off in range(0, buf.nbytes, step):
        n = min(step, buf.nbytes - off)
        buf[off : off + n] = np.frombuffer(rng.bytes(n), dtype=np.uint8)


def stamp(buf: np.ndarray, size: int, count: int, round_id: int) -> None:
    """Write (round_id, j) into the first and last 16 bytes of object j (size >= 32)."""
    view = memoryview(buf).cast("B")
    for j in range(count):
        tag = _STAMP.pack(round_id, j)
        view[j * size : j * size + 16] = tag
        view[(j + 1) * size - 16 : (j + 1) * size] = tag


def checksums(buf: np.ndarray, size: int, count: int) -> list[int]:
    """xxh3-64 of each of the first ``count`` objects of ``size`` bytes."""
    view = memoryview(buf).cast("B")
    return [xxhash.xxh3_64_intdigest(view[j * size : (j + 1) * size]) for j in range(count)]
