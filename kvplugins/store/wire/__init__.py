"""The store's wire: ``protocol`` (framing, op names, per-entry status codes, the version), ``schema`` (every
op's entries and options as typed, range-checked msgspec structs, decoded straight from the wire) and ``replies``
(the answers the client acts on, typed the same way); ``kv_events`` (vLLM's KV event batches, which the master
publishes and the router reads).
Shared by the client, the master and the nodes; imports nothing else of the store."""

__all__ = ["kv_events", "protocol", "replies", "schema"]
