"""One store client per process behind the page stores, surviving an unreachable store (issue #33).

A ResilientClient wraps a client factory. Lifecycle, in call order:
  1. ``ResilientClient(factory, retry_ms, label)``  nothing connects yet.
  2. ``attach(register)``   per owner of memory the client must know (a PageStore's KV blocks or bounce slots):
                            ``register(client)`` runs on every (re)connect, and at once if connected.
  3. ``get()``              the client, connecting on first use; None while the store is down. After a failure
                            it answers None without touching the network until ``retry_ms`` has passed, then
                            tries again; ``get(found_at=t)`` tries at once when the failure came before
                            monotonic time ``t`` (a load that follows a lookup that found its pages since).
     ``failed(err)``        a call on the client raised a store error, or its transfers failed (``failure``):
                            close it, log the first failure once ("store unavailable, serving without it"),
                            back off. "reachable again" is logged when a later connect works.
  4. ``close()``            close the client (the one owner of the ResilientClient calls it).
Thread-safe: engine threads (load, save, lookups) share one. ``errors``: failures counted so far.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from kvplugins.errors import KVPluginsError, LeaseExpired, SlotsBusy, TransferFailed

log = logging.getLogger("kvplugins.layout.pages")  # the page stores' log: operators grep one logger


class ResilientClient:
    """A store client made by ``factory`` (() -> StoreClient), reconnected after ``retry_ms`` of back-off.
    ``label`` names it in the log (a key space namespace)."""

    def __init__(self, factory: Callable[[], Any], retry_ms: float, label: str):
        self._factory, self.label, self.retry_s = factory, label, retry_ms / 1000
        self._client: Any = None
        self._down_until = self._failed_at = 0.0
        self._logged_down = False
        self._lock = threading.RLock()
        self._registrars: list[Callable[[Any], None]] = []
        self.errors = 0

    def attach(self, register: Callable[[Any], None]) -> None:
        """Run ``register(client)`` on every connect from now on (and now, when connected)."""
        with self._lock:
            self._registrars.append(register)
            if self._client is not None:
                register(self._client)

    @property
    def current(self) -> Any:
        """The client if connected now (never connects), else None."""
        return self._client

    def get(self, found_at: float | None = None) -> Any:
        """The connected client, or None (store down, inside the back-off). ``found_at`` (time.monotonic()
        seconds): the store answered a lookup by then; inside the back-off it connects at once when the failure
        came before it (a request found its pages since), never when it came after (the store failed since)."""
        with self._lock:
            if self._client is not None:
                return self._client
            newer = found_at is not None and self._failed_at < found_at
            if not newer and time.monotonic() < self._down_until:
                return None
            client = None
            try:
                client = self._factory()
                for register in self._registrars:
                    register(client)
            except KVPluginsError as e:
                if client is not None:
                    _close_quietly(client)
                self._fail_locked(e)
                return None
            if self._logged_down:
                log.warning("kvplugins: store reachable again (%s)", self.label)
            self._client, self._logged_down = client, False
            return client

    def failed(self, err: Exception) -> None:
        """A call on the client raised ``err`` (a store error): drop the client and back off."""
        with self._lock:
            self._fail_locked(err)

    def _fail_locked(self, err: Exception) -> None:
        self.errors += 1
        if not self._logged_down:
            log.warning("kvplugins: store unavailable, serving without it (retry in %.0f s): %s", self.retry_s, err)
            self._logged_down = True
        if self._client is not None:
            _close_quietly(self._client)
        self._failed_at = time.monotonic()
        self._client, self._down_until = None, self._failed_at + self.retry_s

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def failure(errors: list) -> Exception | None:
    """The first per-key error of a batch that says the store is failing (a transfer to a node that failed or
    timed out: a stopped or cut-off node), else None. A read past its lease (slow, not failing), no free
    bounce slot (this process busy), a missing key, a checksum mismatch or a full store are not failures. The
    engine adapters back off on it as on a raised store error: a node that stopped answering costs one transfer
    timeout, not one per request."""
    return next(
        (e for e in errors if isinstance(e, TransferFailed) and not isinstance(e, (LeaseExpired, SlotsBusy))), None
    )


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a broken client must not mask the error that broke it
        pass
