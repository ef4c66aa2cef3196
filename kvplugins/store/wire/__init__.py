"""The store's wire: ``protocol`` (framing, op names, per-entry status codes, the version) and ``schema`` (every
op's entries, options and replies as typed, range-checked msgspec structs, decoded straight from the wire).
Shared by the client, the master and the nodes; imports nothing else of the store."""
__all__ = ["protocol", "schema"]
