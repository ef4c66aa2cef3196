"""What the master, node and client rooms share about a cluster in etcd: ``etcd`` (the etcd v3 client over its
HTTP/JSON gateway, key layout, fenced transactions), ``ring`` (consistent hashing of keys over shards) and
``membership`` (a sharded store's members and moves). Sharded masters: store/master/shard.py; clients' routing:
store/client/router.py; nodes' DRAM over the shards: store/node/extents.py. Operators: docs/operations.md,
*Sharded masters*."""
