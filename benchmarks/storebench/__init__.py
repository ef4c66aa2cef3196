"""Cross-process store benchmark (issue #2): our store (shm and forced-TCP transport) vs Mooncake's TCP store.

Map: ``workload`` (cases, stamping, checksums) -> ``clients`` (one adapter per store, used inside workers)
-> ``worker`` (a writer / reader / segment process speaking JSON lines) -> ``procs`` (spawning and talking to
workers, ports) -> ``clusters`` (each store's server processes) -> ``driver`` (runs every case through a
writer and a reader, verifies bytes) -> ``report`` (percentiles, ratios, targets, table, JSON)
-> ``netns`` (a private network namespace for Mooncake, whose servers bind 0.0.0.0).
Entry point: ``benchmarks/store_bench.py``.
"""
