"""A DRAM segment this process contributes to the pool: allocated with TransferEngine.alloc_shared (memfd/shm,
exported), registered with the master with its SegmentDescriptor, kept alive by a heartbeat thread.

Used by a store node (over the zmq control plane) and by a StoreClient with ``segment_size > 0`` (over its own
raw connection). If the master forgets the segment (it was silent past heartbeat_timeout_ms + suspect_grace_ms,
or the master restarted) the next heartbeat re-registers it with the same owner token, and the master gives back
the objects it held then (master/liveness.py; after a restart of a master without etcd they are gone).
"""

from __future__ import annotations

import logging
import secrets
import threading

from kvplugins.errors import AuthError, MasterUnreachable, StoreError
from kvplugins.security import resolve
from kvplugins.security.secret import owner_proof
from kvplugins.store.wire.protocol import NOT_FOUND, OK

log = logging.getLogger(__name__)


class OwnedSegment:
    """``size`` bytes of exported shared memory registered as a segment. ``rpc``: a Raw/ZmqRpcClient.
    ``prefault``: commit every page at start (TransferEngine.alloc_shared populate) so puts never fault.
    ``region``: register this already allocated exported region instead (``size`` is then ignored)."""

    def __init__(self, engine, size: int, rpc, heartbeat_interval_ms: int, prefault: bool = False, region=None):
        self.engine, self.rpc, self.interval_s = engine, rpc, heartbeat_interval_ms / 1000
        self._owner = secrets.token_hex(32)  # binds the name to this process (master/segments.py)
        self.region = region or engine.alloc_shared(int(size), export=True, populate=prefault)
        self.name = self._register()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"kvp-heartbeat-{self.name}", daemon=True)
        self._thread.start()

    def _register(self) -> str:
        wire = self.engine.descriptor().to_wire()
        [(code, value)] = self.rpc.call(
            "register_segment",
            [[wire, self.region.region_id, self.region.length]],
            {"owner": self._owner, **owner_proof(resolve(), self._owner)},
        )
        if code != OK:
            raise StoreError(f"master {self.rpc.address} refused the segment: {value}")
        log.info("segment %s registered (%d bytes)", value, self.region.length)
        return value

    def _beat(self) -> None:
        down = False
        while not self._stop.wait(self.interval_s):
            try:
                [(code, _)] = self.rpc.call("heartbeat", [self.name])
                if code == NOT_FOUND:
                    log.warning("master forgot segment %s; registering it again", self.name)
                    self.name = self._register()
                if down:
                    log.info("master %s reachable again", self.rpc.address)
                down = False
            except (MasterUnreachable, StoreError, AuthError) as e:
                if not down:
                    log.warning("heartbeat failed: %s", e)
                down = True
            except Exception:  # noqa: BLE001 - a dead heartbeat thread loses the segment 32 s later: keep beating
                log.exception("heartbeat of %s failed; heart-beating goes on", self.name)
                down = True

    def close(self) -> None:
        """Stop heart-beating and unregister (best effort: the master times the segment out anyway)."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.rpc.call("unregister", [self.name], {"owner": self._owner}, timeout_ms=min(self.rpc.timeout_ms, 1000))
        except StoreError as e:
            log.info("unregister of %s skipped: %s", self.name, e)
