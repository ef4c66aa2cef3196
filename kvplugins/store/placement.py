"""Where a put's object goes and how long it must stay: ``PutConfig``, given per put call or taken from the
ClientConfig defaults (``replicas``, ``preferred_segment``, ``pin``, ``pin_ttl_ms``).

* ``replicas``: copies written by the put, each on a distinct segment (on distinct hosts first when the pool
  has several hosts); fewer if the pool has fewer registered segments. While registered segments are suspect
  (silent) or not yet admitted, a put that cannot place min(replicas, registered segments) copies on live ones
  is StoreFull (retry): it is never acknowledged with fewer copies than it asked for and the pool could hold.
* ``preferred_segment``: segment name (as ``status`` lists it, "<segment id>:<region id>") that gets the first
  replica when it has room; otherwise the usual most-free-first order. '' = no preference.
* ``pin``: "none" (plain LRU), "soft" (evicted only after every unpinned object, until ``pin_ttl_ms`` after the
  put; then it rejoins the LRU as most recently used) or "hard" (never evicted; removed only by ``remove``, or
  lost with its segments). A put that finds only hard-pinned, leased or pending objects in its way is StoreFull.
The config applies to objects the put creates; a put of an existing key stays a no-op. Follows Mooncake's
ReplicateConfig (replica_num, preferred_segment, with_soft_pin) plus a hard pin.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvplugins.errors import ConfigError

PINS = ("none", "soft", "hard")
PIN_CODES = {"none": 0, "soft": 1, "hard": 2}  # metadata.Object.pin


@dataclass(frozen=True)
class PutConfig:
    """Placement of one put call (see the module docstring). Raises ConfigError for a bad value."""

    replicas: int = 1
    preferred_segment: str = ""
    pin: str = "none"
    pin_ttl_ms: int = 60_000

    def __post_init__(self):
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(f"replicas={self.replicas!r} must be an int >= 1")
        if self.pin not in PINS:
            raise ConfigError(f"pin={self.pin!r} must be one of {', '.join(PINS)}")
        if self.pin == "soft" and self.pin_ttl_ms <= 0:
            raise ConfigError(f"pin_ttl_ms={self.pin_ttl_ms} must be > 0 ms for a soft pin, e.g. 60000")
        if not isinstance(self.preferred_segment, str):
            raise ConfigError(f"preferred_segment={self.preferred_segment!r} must be a segment name string")

    @cached_property
    def wire(self) -> dict:
        """The put_start options for this config (only what differs from the master's defaults)."""
        opts: dict = {"replicas": self.replicas}
        if self.preferred_segment:
            opts["segment"] = self.preferred_segment
        if self.pin != "none":
            opts["pin"] = PIN_CODES[self.pin]
            opts["pin_ttl_ms"] = int(self.pin_ttl_ms)
        return opts


def from_client(cfg) -> PutConfig:
    """The default PutConfig of a ClientConfig ``cfg``."""
    return PutConfig(
        replicas=cfg.replicas, preferred_segment=cfg.preferred_segment, pin=cfg.pin, pin_ttl_ms=cfg.pin_ttl_ms
    )
