"""Fragmentation of the segment allocator under LRU churn: ``python -m kvplugins.store.master.fragmentation``.

Puts objects into one 64 MiB segment, evicting least recently put objects on demand (as put_start does) until
the new object fits. Reports per workload: segment usage right after each put that needed eviction (how full a
"full" segment really is), free blocks left, and over-eviction (bytes evicted beyond the object's size, per put
byte). The table in docs/store.md comes from this script.
"""

from __future__ import annotations

import random
import statistics
from collections import OrderedDict

from kvplugins.store.master.allocator import Allocator

WORKLOADS = {
    "uniform 256 KiB pages": lambda r: 256 << 10,
    "three sizes 64K/256K/1M": lambda r: r.choice([64 << 10, 256 << 10, 1 << 20]),
    "random 4 KiB..1 MiB": lambda r: r.randint(4 << 10, 1 << 20),
}


def simulate(size_of, puts: int = 20000, capacity: int = 64 << 20, seed: int = 1) -> dict:
    rng, alloc, lru = random.Random(seed), Allocator(capacity, 64), OrderedDict()
    usage, blocks, over, put_bytes = [], [], 0, 0
    for i in range(puts):
        size = size_of(rng)
        need, evicted = alloc.rounded(size), 0
        while (off := alloc.alloc(size)) is None:
            _, (o, s) = lru.popitem(last=False)
            alloc.free(o)
            evicted += s
        if evicted:
            over += max(0, evicted - need)
            usage.append(alloc.used_bytes / capacity)
            blocks.append(alloc.free_blocks())
        lru[i] = (off, need)
        put_bytes += need
    return {
        "usage_mean": statistics.mean(usage),
        "usage_min": min(usage),
        "free_blocks": statistics.mean(blocks),
        "over_eviction": over / put_bytes,
    }


def main() -> None:
    for name, fn in WORKLOADS.items():
        r = simulate(fn)
        print(
            f"{name:26s} usage mean {r['usage_mean']:.3f} min {r['usage_min']:.3f}  "
            f"free blocks {r['free_blocks']:.1f}  over-eviction {r['over_eviction']:.3f}"
        )


if __name__ == "__main__":
    main()
