"""Hash-sharded masters (issue #18 part 3): N masters each own a hash range of the keys (``ring.py``), with
their membership in etcd (``cluster.py``); a master checks and sweeps the keys it owns (``master.py``), clients
route each batch per shard (``router.py``), nodes spread their DRAM over the shards (``extents.py``).
Operators: docs/operations.md, *Sharded masters*."""
