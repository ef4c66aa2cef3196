"""Small Pythonic wrapper over the raw nanobind module ``kvplugins._native``.

Native failures become kvplugins exceptions here and nowhere else. Blocking native calls release the GIL.
"""

from __future__ import annotations

import numpy as np

from kvplugins.errors import NativeError


def _mod():
    try:
        from kvplugins import _native
    except ImportError as e:  # pragma: no cover - a broken install
        raise NativeError(f"kvplugins native module is not built ({e}); reinstall with `pip install .`") from e
    return _native


def copy(dst_addr: int, src_addr: int, nbytes: int) -> None:
    """memcpy ``nbytes`` from address ``src_addr`` to ``dst_addr`` with the GIL released."""
    if nbytes:
        _mod().copy(dst_addr, src_addr, nbytes)


def copy_batch(
    dst_addrs, src_addrs, lengths, threads: int = 1, digests: np.ndarray | None = None, isa: str = "auto"
) -> None:
    """Copy span i: ``lengths[i]`` bytes from ``src_addrs[i]`` to ``dst_addrs[i]`` (uint64 sequences).

    Spans must not overlap. With threads > 1 and >= 4 MiB in all, the copy is split across threads.
    ``digests`` (uint64 array, one per span): also set ``digests[i]`` to the xxh3_64 of span i's bytes
    (``xxhash.xxh3_64_intdigest``), hashed in the same pass as the copy (64 KiB chunks, each hashed from the
    destination right after it is copied); threads then take whole spans. ``isa``: the xxh3 tier, ``auto``
    or one of hash_tiers(). Raises NativeError if the sequences differ in length or ``isa`` is not supported.
    """
    if (
        type(dst_addrs) is list
        and type(src_addrs) is list
        and type(lengths) is list
        and len(dst_addrs) == len(src_addrs) == len(lengths)
    ):
        d, s, n = np.array((dst_addrs, src_addrs, lengths), dtype=np.uint64)  # a small batch: one conversion
    else:
        d = np.ascontiguousarray(dst_addrs, dtype=np.uint64)
        s = np.ascontiguousarray(src_addrs, dtype=np.uint64)
        n = np.ascontiguousarray(lengths, dtype=np.uint64)
    try:
        _mod().copy_batch(d, s, n, int(threads), digests, isa)
    except ValueError as e:
        raise NativeError(str(e)) from e


def hash_keys(addrs, lengths, owner, nkeys: int, threads: int = 1, isa: str = "auto") -> np.ndarray:
    """xxh3_64 per key (uint64 array of ``nkeys``): key k's digest covers the concatenation of the spans i
    (addresses, byte lengths) with ``owner[i] == k``, in order; a key with no spans gets the digest of no
    bytes. A key's spans must be consecutive. Every span must be readable memory (the caller checked its
    registration). GIL released; keys are split across ``threads`` from 4 MiB. Raises NativeError for
    sequences of different lengths, an owner >= nkeys, a key's spans not consecutive, or an unsupported isa."""
    out = np.empty(int(nkeys), dtype=np.uint64)
    a = np.ascontiguousarray(addrs, dtype=np.uint64)
    n = np.ascontiguousarray(lengths, dtype=np.uint64)
    o = np.ascontiguousarray(owner, dtype=np.uint64)
    try:
        _mod().hash_keys(a, n, o, out, int(threads), isa)
    except ValueError as e:
        raise NativeError(str(e)) from e
    return out


def hash_tiers() -> list[str]:
    """The xxh3 tiers this CPU and OS support, best first (``avx512``, ``avx2``, ``sse2``)."""
    return _mod().hash_tiers().split(",")


def shm_maps():
    """A native table of the peer regions this process maps over shm (the shm transport keeps it: ``add(segment id,
    region id, address, length, pidfd)``, ``alias(segment name, segment id)``, ``forget(segment id)``, ``clear()``,
    ``counts()`` -> (reads, bytes) done by get_one). forget and clear wait for reads in flight."""
    return _mod().ShmMaps()


def get_one(fd: int, rid: int, key: str, addrs: list[int], lens: list[int], timeout_ms: float, maps, verify: bool):
    """One store get in one native call, GIL released (native/src/store/one_op.h): sends the master's ``get``
    of ``key`` as request ``rid`` on the connected socket ``fd``, reads the reply frame and, when the object's
    first replica is in a region of ``maps``, reads its bytes into the local spans (addresses and byte lengths
    of writable registered memory, summing to the object's size) and checks its xxh3_64 (``verify``). Returns
    (True, size in bytes) when done, (True, None) for a miss (the key is not stored), (False, reply body) for
    the caller to go on from. Raises TimeoutError (no reply within ``timeout_ms``), ConnectionError (the socket
    failed; the connection is not usable after either)."""
    return _op(_mod().get_one(fd, rid, key, addrs, lens, float(timeout_ms), maps, bool(verify)))


def put_one(
    fd: int,
    rid: int,
    key: str,
    addrs: list[int],
    lens: list[int],
    slab: tuple[str, int, int, int],
    write_ms: float,
    timeout_ms: float,
    maps,
):
    """One slab put in one native call, GIL released (native/src/store/one_op.h): copies the local spans
    (addresses and byte lengths of registered memory) to ``slab`` = (segment name, region id, offset, slab id)
    where ``maps`` maps that region, hashing them, then sends the master's ``put`` of ``key`` as request ``rid``
    on socket ``fd`` and reads its reply. ``write_ms``: the time left to write into the slab. Returns (True,
    None) when nothing was written or sent (the region is not mapped here, its owner is gone, or no time is
    left), (True, the entry's code: OK or EXISTS) when done, (False, reply body) for the caller to go on from.
    Raises TimeoutError, ConnectionError as get_one."""
    segment, region, offset, slab_id = slab
    return _op(
        _mod().put_one(
            fd, rid, key, addrs, lens, segment, region, offset, slab_id, float(write_ms), float(timeout_ms), maps
        )
    )


def _op(result: tuple[int, object]) -> tuple[bool, object]:
    """A native store op's (status, value) as (done, value); its I/O failures raised as TimeoutError and
    ConnectionError (the one place its status codes become exceptions)."""
    status, value = result
    if status in (0, 1, 5):
        return True, value
    if status == 2:
        return False, value
    raise (TimeoutError if status == 4 else ConnectionError)(value)
