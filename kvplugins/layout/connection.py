"""One store client per process behind the page stores, surviving an unreachable store (issue #33).

A ResilientClient wraps a client factory. Lifecycle, in call order:
  1. ``ResilientClient(factory, retry_ms, label)``  nothing connects yet.
  2. ``attach(register)``   per owner of memory the client must know (a PageStore's KV blocks or bounce slots):
                            ``register(client)`` runs on every (re)connect, and at once if connected.
  3. ``get()``              the client, connecting on first use; None while the store is down. After a failure
                            it answers None without touching the network until ``retry_ms`` has passed, then
                            tries again; ``get(now=True)`` tries at once (a load that follows a lookup that
                            just found its pages).
     ``failed(err)``        a call on the client raised a store error: close it, log the first failure once
                            ("store unavailable, serving without it"), back off. "reachable again" is logged
                            when a later connect works.
  4. ``close()``            close the client (the one owner of the ResilientClient calls it).
Thread-safe: engine threads (load, save, lookups) share one. ``errors``: failures counted so far.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from kvplugins.errors import KVPluginsError

log = logging.getLogger("kvplugins.layout.pages")  # the page stores' log: operators grep one logger


class ResilientClient:
    """A store client made by ``factory`` (() -> StoreClient), reconnected after ``retry_ms`` of back-off.
    ``label`` names it in the log (a key space namespace)."""

    def __init__(self, factory: Callable[[], Any], retry_ms: float, label: str):
        self._factory, self.label, self.retry_s = factory, label, retry_ms / 1000
        self._client: Any = None
        self._down_until = 0.0
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

    def get(self, now: bool = False) -> Any:
        """The connected client, or None (store down, inside the back-off unless ``now``)."""
        with self._lock:
            if self._client is not None:
                return self._client
            if not now and time.monotonic() < self._down_until:
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
        self._client, self._down_until = None, time.monotonic() + self.retry_s

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a broken client must not mask the error that broke it
        pass
