"""Logging of refused peers: one warning line per peer host and interval, so a misconfigured client retrying
in a loop cannot flood the log (the suppressed count is reported with the next line)."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("kvplugins.security")


class RefusalLog:
    """``refused(what, peer, reason)`` logs "refused <what> from <peer>: <reason>" at most once per
    ``interval_s`` per (peer host, what, reason). Thread-safe; one per server."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[tuple, tuple[float, int]] = {}  # (host, what, reason) -> (last line's time, suppressed)
        self.count = 0

    def refused(self, what: str, peer, reason: str) -> None:
        host = str(peer[0]) if isinstance(peer, tuple) else str(peer).rsplit(":", 1)[0]
        key = (host, what, reason)
        shown = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        now = time.monotonic()
        with self._lock:
            self.count += 1
            last, hidden = self._last.get(key, (-1e18, 0))
            if now - last < self.interval_s:
                self._last[key] = (last, hidden + 1)
                return
            self._last[key] = (now, 0)
            if len(self._last) > 4096:  # bounded: forget the oldest hosts
                for key in sorted(self._last, key=lambda k: self._last[k][0])[:1024]:
                    del self._last[key]
        more = f" ({hidden} more like it from {host} not logged)" if hidden else ""
        log.warning("refused %s from %s: %s%s", what, shown, reason, more)
