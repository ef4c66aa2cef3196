"""Pieces of benchmarks/hicache_bench.py: backends.py (each L3 backend, built and attached as SGLang does)."""
