"""Leader election among masters: the leader holds ``{prefix}/leader`` under an etcd lease.

Campaign: if the key is absent, grant a lease of ``ttl_s`` and create the key with this master's value under it
(an etcd transaction comparing create_revision == 0, so exactly one master wins). The leader refreshes the lease
every ttl/3; it considers itself leader only until ``refresh time + 0.9 * ttl`` (before etcd can expire the
lease and elect another), so two masters never both act as leader. A killed leader's key vanishes when its
lease expires (about ``ttl_s``); a stopped leader revokes it (immediate hand-over). Follows etcd's
concurrency/election recipe (clientv3/concurrency), polling instead of watching.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from kvplugins.errors import StoreError

log = logging.getLogger(__name__)
SAFETY = 0.9  # fraction of the lease TTL this master trusts after a successful refresh


class Elector:
    """Campaign for and keep leadership of ``key`` with ``value`` (bytes, unique per master process).
    ``etcd``: ha.etcd.Etcd. ``ttl_ms``: lease TTL (rounded up to whole seconds, etcd's unit)."""

    def __init__(self, etcd, key: str, value: bytes, ttl_ms: int, poll_ms: int = 200):
        self.etcd, self.key, self.value = etcd, key, value
        self.ttl_s = max(1, math.ceil(ttl_ms / 1000))
        self.poll_s = min(poll_ms / 1000, self.ttl_s / 4)
        self._lease: int | None = None  # etcd lease id while leading
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvp-elector", daemon=True)

    def start(self) -> "Elector":
        self._thread.start()
        return self

    def is_leader(self) -> bool:
        """True while this master holds a lease it refreshed recently enough (thread-safe, no I/O)."""
        return self._lease is not None and time.monotonic() < self._valid_until

    def lost(self, why: str) -> None:
        """Step down now (e.g. a fenced write found another leader); campaigns again later."""
        if self._lease is not None:
            log.warning("leadership of %s lost: %s", self.key, why)
        self._lease, self._valid_until = None, 0.0

    def stop(self) -> None:
        """Stop campaigning; a leader revokes its lease so a standby takes over at once."""
        self._stop.set()
        self._thread.join(timeout=5)
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self.etcd.revoke(lease)
            except StoreError as e:
                log.info("lease revoke skipped: %s", e)

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self._keep_alive() if self._lease is not None else self._campaign()
                failing = False
            except Exception as e:  # noqa: BLE001 - etcd errors and odd replies: retry, never kill the thread
                if not failing:
                    log.warning("election: %s", e)
                failing = True
                if self._lease is not None and time.monotonic() >= self._valid_until:
                    self.lost("lease not refreshed in time")
            self._stop.wait(self.ttl_s / 3 if self._lease is not None else self.poll_s)

    def _campaign(self) -> None:
        if self.etcd.get(self.key) is not None:
            return
        t0 = time.monotonic()
        lease = self.etcd.lease(self.ttl_s)
        if not self.etcd.create(self.key, self.value, lease):
            self.etcd.revoke(lease)
            return
        self._valid_until = t0 + SAFETY * self.ttl_s
        self._lease = lease
        log.info("elected leader of %s", self.key)

    def _keep_alive(self) -> None:
        t0, lease = time.monotonic(), self._lease
        ttl = self.etcd.refresh(lease)
        if lease != self._lease:
            return  # stepped down meanwhile
        if ttl <= 0:
            self.lost("lease expired")
        else:
            self._valid_until = t0 + SAFETY * ttl
