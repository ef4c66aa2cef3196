"""Per-identity bounds on what the master holds for one named credential (issue #30).

An *identity* is a named role credential (``kvplugins credential --role client --name engine-a``: the
handshake proves ``client:engine-a``, security/handshake.py); on the zmq control plane every credential of a
role shares ``role:*`` (security/curve.py). The cluster secret is the cluster itself (it may drain and remove
everything): its connections carry identity "" and only the global limits apply to them.

Bounded per identity, each answered with STORE_FULL naming the setting:
* pending puts (started, not committed): ``max_pending_puts_per_identity`` (put_start);
* bytes held by its pending puts and its reserved slabs: ``max_pending_share`` of the pool's DRAM (put_start,
  reserve);
* live segments of a node credential: ``max_segments_per_identity`` (segments.py, register_segment);
* raw RPC connections: ``max_connections_per_identity`` (security/limits.py ConnGate).

Accounting is exact, not sampled: every way a pending put ends (commit, abort, expiry, removal, its segment
lost: service.py) and every way a slab ends (slabs.py ``_free_rest``) calls ``done``. With no named credential
connected the tables stay empty and nothing is counted. Source followed: Ceph's per-client capabilities and
quotas; Redis and Mooncake bound no client's share.
"""

from __future__ import annotations

from kvplugins.store.wire.protocol import OK, STORE_FULL


class Quotas:
    """Pending puts and slab bytes per identity, for one MasterService (``cfg``: its MasterConfig;
    ``capacity()``: the pool's DRAM in bytes)."""

    def __init__(self, cfg, capacity):
        self.cfg, self._capacity = cfg, capacity
        self._held: dict[str, dict] = {}  # identity -> {key, or ("slab", id): bytes}
        self._bytes: dict[str, int] = {}
        self._who: dict = {}  # key or ("slab", id) -> identity

    def room(self, caller: str, sizes: list[int], slabs: bool = False) -> tuple[int, str | None]:
        """How many leading ``sizes`` (bytes of new puts, or of slabs with ``slabs``) ``caller`` may take now,
        and the STORE_FULL text for the rest (None when all fit)."""
        if not caller:
            return len(sizes), None
        held, used = self._held.get(caller, {}), self._bytes.get(caller, 0)
        cap_bytes = int(self.cfg.max_pending_share * self._capacity())
        n = len(sizes) if slabs else min(len(sizes), max(0, self.cfg.max_pending_puts_per_identity - len(held)))
        k = 0
        while k < n and used + sizes[k] <= cap_bytes:
            used += sizes[k]
            k += 1
        if k == len(sizes):
            return k, None
        if k < n:  # (the state once the first k are placed)
            why = (
                f"credential {caller} holds {used} bytes in pending puts and slabs; another "
                f"{sizes[k]} would pass max_pending_share={self.cfg.max_pending_share:g} of the pool's "
                f"{self._capacity()} bytes"
            )
        else:
            why = (
                f"credential {caller} has {len(held) + k} puts pending (started, not committed), the master's "
                f"max_pending_puts_per_identity={self.cfg.max_pending_puts_per_identity}"
            )
        return k, why + "; commit or abort them, or give each process its own credential (kvplugins credential --name)"

    def took(self, caller: str, items, answers) -> None:
        """Record what ``caller`` was given: ``items`` [(key or ("slab", id), bytes)] whose answer is OK."""
        if not caller:
            return
        held = self._held.setdefault(caller, {})
        total = self._bytes.get(caller, 0)
        for (item, size), answer in zip(items, answers):
            if answer[0] == OK and item not in self._who:
                held[item] = size
                self._who[item] = caller
                total += size
        self._bytes[caller] = total

    def done(self, items) -> None:
        """``items`` (keys, or ("slab", id)) ended: pending puts committed or dropped, slabs freed."""
        if not self._who:
            return
        for item in items:
            who = self._who.pop(item, None)
            if who is not None:
                self._bytes[who] -= self._held[who].pop(item)
                if not self._held[who]:
                    del self._held[who], self._bytes[who]

    def usage(self) -> dict[str, list[int]]:
        """{identity: [pending puts and slabs, bytes]} (status)."""
        return {who: [len(held), self._bytes[who]] for who, held in self._held.items()}


def refuse(answers: list, k: int, n: int, why: str) -> list:
    """``answers`` of the first ``k`` entries followed by STORE_FULL ``why`` for the other ``n - k``."""
    return answers + [[STORE_FULL, why]] * (n - k)
