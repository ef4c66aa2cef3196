"""The disk tier of a store node (issue #6): objects evicted from DRAM are offloaded to files on the node's
``--disk-dir`` and promoted back to DRAM on a get.

files.py    crash-safe object file format (header with key, size, xxh3_64 checksum; tmp + fsync + rename)
store.py    DiskStore: the node-local file index, capacity accounting, LRU eviction of files
worker.py   NodeTier: the node's link to the master (registration, polled offload/delete/migrate commands)
server.py   the node's promote endpoint (framed msgpack over TCP, the master's raw frame format)
drain.py    ``kvplugins store --drain``: mark a segment draining and wait until it has left
The master side is kvplugins/store/master/tiering.py (offload, promote, drain bookkeeping); the client side
of promote on hit, store/client/promote.py.
"""
