"""The master's disk-tier seam: what eviction does with a victim, and how a get answers a disk-resident object.

MasterService owns one Tiering. The base class has no disk tier: an evicted object is dropped. The disk-tier
implementation (issue #6: offload on evict, promote on hit) overrides these hooks; it may keep state of its own
and add ops of its own through ``ops()``.
"""
from __future__ import annotations


class Tiering:
    def __init__(self, service=None):
        self.service = service

    def evict(self, obj, now: float, urgent: bool) -> bool:
        """Eviction chose ``obj``. Return True if the tier took it over (the service must not drop it), False to
        let the service drop it. ``urgent``: a put is waiting for the space now (on-demand eviction), so only a
        step that frees DRAM at once helps; False from the watermark sweep. After True, ``obj`` must no longer be a
        victim (eviction.victims) or its DRAM must be free, or the on-demand loop would pick it again."""
        return False

    def get(self, obj, now: float):
        """A get found ``obj`` complete but with no DRAM replica. Return the per-entry result
        (``[protocol.ON_DISK, value]`` or ``[protocol.NOT_FOUND, None]``)."""
        from kvplugins.store.protocol import NOT_FOUND
        return [NOT_FOUND, None]

    def ops(self) -> dict:
        """Extra RPC ops: name -> fn(entries, opts, now)."""
        return {}

    def tick(self, now: float) -> None:
        """Called on every master sweep."""

    def status(self) -> dict:
        """Merged into the ``status`` op's answer."""
        return {}
