"""The store master: metadata (metadata.py), allocator (allocator.py), eviction (eviction.py), segment registry
(segments.py), the batch operations (service.py) and the two RPC endpoints (rpc_server.py)."""
