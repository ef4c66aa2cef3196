"""Corrupt a stored object in place: one byte of one replica XORed inside the store node's segment, written
through the segment's shm file named in its SegmentDescriptor (tests run as the node's user). The object's
checksum no longer matches, so every read of that replica fails its check."""

from __future__ import annotations


def flip_stored_byte(client, key: str, at: int | None = None, mask: int = 0x5A, replica: int = 0) -> None:
    """XOR byte ``at`` (default: the middle) of ``key``'s replica ``replica`` with ``mask`` (non-zero)."""
    [(_, (size, locs, _, _))] = client._rpc.call("get", [key])
    seg, region_id, off = locs[replica]
    [(_, wire)] = client._rpc.call("describe", [seg])
    path = next(r[2] for r in wire["regions"] if r[0] == region_id)
    pos = off + (size // 2 if at is None else at)
    with open(path, "r+b") as f:
        f.seek(pos)
        old = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([old ^ mask]))
