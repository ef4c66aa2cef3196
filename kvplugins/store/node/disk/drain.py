"""``kvplugins store --drain --master ADDR --segment NAME``: ask the master to drain a node and wait until it left.

The master stops placing objects on the segment; the node migrates each of its objects (DRAM and disk) to other
segments through the transfer core, then unregisters and exits (master/drain.py, disk/worker.py). Reads keep
working throughout: a replica is switched only after its copy landed, and the old bytes stay valid for one lease.
"""

from __future__ import annotations

import time

from kvplugins.errors import StoreError
from kvplugins.store.wire.protocol import OK
from kvplugins.store.client.connect import master_client

POLL_S = 0.2


def drain(master: str, segment: str, timeout_ms: float, rpc_timeout_ms: float, out=print) -> None:
    """Drain ``segment`` of the master at ``master``; returns once it left the pool. Raises StoreError (unknown
    segment, or still there after ``timeout_ms``: objects that cannot fit elsewhere keep it), MasterUnreachable."""
    rpc = master_client(master, rpc_timeout_ms, "admin")
    try:
        [(code, why)] = rpc.call("drain", [segment])
        if code != OK:
            raise StoreError(f"cannot drain {segment}: {why}")
        deadline, last = time.monotonic() + timeout_ms / 1000, None
        while (left := _objects_on(rpc, segment)) is not None:
            if left != last:
                out(f"draining {segment}: {left} objects left", flush=True)
                last = left
            if time.monotonic() > deadline:
                raise StoreError(
                    f"{segment} still holds {left} objects after {timeout_ms:g} ms; is there room "
                    "on the other segments? (raise --drain-timeout-ms or add a node)"
                )
            time.sleep(POLL_S)
        out(f"{segment} drained and left the pool", flush=True)
    finally:
        rpc.close()


def _objects_on(rpc, segment: str) -> int | None:
    """Objects still on ``segment`` (its DRAM and its node's disk), or None once it left."""
    st = rpc.call("status")
    for seg in st["segments"]:
        if seg["name"] == segment:
            return seg["objects"] + st.get("tier_segments", {}).get(segment, {}).get("disk_objects", 0)
    return None
