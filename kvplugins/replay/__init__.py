"""Capacity planning from request traces: ``kvplugins replay`` replays a trace (Mooncake's FAST'25 format, our
token-block-hash JSONL, or a synthetic one) through per-instance LRU caches and the real store, and reports the
hit ratio, prefill tokens saved and the store's throughput per pool capacity (docs/capacity.md).

trace.py (formats) -> plan.py (configurations, object sizes) -> runner.py (the replay) through caches.py (local
caches, routing, the reference LRU) and pool.py (the store) -> report.py (table, JSON, plot); synth.py generates
traces; shapes.py sizes a block's KV per model.
"""
