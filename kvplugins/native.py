"""Small Pythonic wrapper over the raw nanobind module ``kvplugins._native``.

Native failures become kvplugins exceptions here and nowhere else. Blocking native calls release the GIL.
"""

from __future__ import annotations

import functools

import numpy as np

from kvplugins.errors import NativeError


@functools.cache  # imported once: an import statement per call cost ~0.7 µs, twice per store op
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
    ``counts()`` -> (objects, bytes) moved by get_many and put_many). forget and clear wait for copies in flight."""
    return _mod().ShmMaps()


def tcp_peers(per_peer: int, max_frame: int):
    """The TCP transport's native pool of idle, authenticated connections (native/src/tcp/peers.h), at most
    ``per_peer`` per peer (a "host:port" string): ``take(peer)`` -> fd or -1 (the caller owns it), ``give(peer,
    fd)`` -> False when full (the caller closes fd), ``drop(peer)`` / ``clear()`` -> the fds removed (the caller
    closes them); and the routes a store client's native get reads over: ``route(segment name, region id, region
    bytes, peer, frame payload limit)``, ``unroute(segment name)``; ``counts()`` -> (objects, bytes) read that way.
    ``max_frame``: this process's largest frame (bytes)."""
    return _mod().TcpPeers(int(per_peer), int(max_frame))


def tcp_fast_routes(peers, max_spans: int, timeout_ms: float, max_routes: int):
    """The TCP transport's native route table for small batches (native/src/tcp/fast.h) over ``peers``
    (tcp_peers); kvplugins/transfer/tcp_fast.py wraps it."""
    return _mod().TcpFastRoutes(peers, int(max_spans), float(timeout_ms), int(max_routes))


def cma_fast_routes(max_spans: int, max_routes: int):
    """The cma transport's native route table for small batches (native/src/cma/fast.h);
    kvplugins/transfer/cma_fast.py wraps it."""
    return _mod().CmaFastRoutes(int(max_spans), int(max_routes))


def writable_spans(spans_per_key: list, starts, ends, writable, small: int) -> tuple | None:
    """A batch's spans (per key a list or tuple of (address, bytes) int pairs) as uint64 arrays (addresses, lengths,
    per-key start offsets; int lists for at most ``small`` spans), bytes per key (an int list) and the total bytes, when each span lies whole in the last-starting region
    of the sorted region index (``starts``, ``ends``: uint64 arrays, ``writable``: bool array) that starts at or
    before it, and that region is writable; None otherwise (or for anything else than int pairs in lists)."""
    got = _mod().writable_spans(spans_per_key, starts, ends, writable, small)
    if got is None or type(got[0]) is list:
        return got
    addrs, lens, starts, sizes, total = got
    arrays = (np.frombuffer(c, dtype=np.uint64) for c in (addrs, lens, starts))
    return (*arrays, np.frombuffer(sizes, dtype=np.uint64).tolist(), total)


def get_many(
    fd: int,
    rid: int,
    keys: list[str],
    addrs,
    lens,
    starts,
    timeout_ms: float,
    maps,
    verify: bool,
    peers=None,
    transfer_timeout_ms: float = 0.0,
):
    """A store get of ``keys`` in one native call, GIL released (native/src/store/one_op.h): sends the master's
    column-form ``get`` as request ``rid`` on the connected socket ``fd``, reads the reply and reads each hit whose
    first replica is in a region of ``maps`` into its key's spans (key k's: ``[starts[k], starts[k+1])``
    of the uint64 arrays ``addrs``, ``lens``: writable registered memory), checking its xxh3_64 (``verify``) and
    its lease; hits in a region ``peers`` (tcp_peers, or None) routes to a TCP peer are planned as frame batches
    over its idle pooled connections (within ``transfer_timeout_ms``). Returns (per key a byte: 0 read and checked, 1 not stored, 2 for the caller to go on from the reply,
    6 a TCP read planned; the reply body when a key is 2, else None; the planned TCP reads or None: ``tcp.run(codes)``
    -> the codes with each 6 now 0 or 2 (to look up again), GIL released, called once the socket ``fd`` is free for
    other threads, while the spans' memory stays registered). ``addrs``, ``lens``, ``starts``: int lists or uint64 arrays.
    Raises TimeoutError (no reply within ``timeout_ms``), ConnectionError (the socket failed; the connection is
    not usable after either), NativeError for spans not matching the keys, TypeError for a key that is not a str."""
    lists = type(addrs) is list and type(lens) is list and type(starts) is list
    run = _mod().get_many_lists if lists else _mod().get_many
    cols = _columns(lists, addrs, lens, starts)
    try:
        status, codes, body, tcp = run(fd, rid, keys, *cols, timeout_ms, maps, verify, peers, transfer_timeout_ms)
    except ValueError as e:
        raise NativeError(str(e)) from e
    _raise_failed(status, body)
    return codes, body, tcp


def put_many(
    fd: int,
    rid: int,
    keys: list[str],
    addrs,
    lens,
    starts,
    slab: tuple[str, int, int],
    offsets,
    write_ms: float,
    timeout_ms: float,
    maps,
    written: list[int] | None = None,
):
    """A slab put of ``keys`` in one native call, GIL released (native/src/store/one_op.h): copies each key's spans
    (as get_many's, registered memory) to ``offsets[k]`` of the slab ``slab`` = (segment name, region id, slab id)
    where ``maps`` maps its region, hashing them, then sends the master's ``put`` as request ``rid`` on socket
    ``fd`` and reads its reply. ``write_ms``: the time left to write into the slab. Returns None when nothing was
    written or sent (the region is not mapped here, its owner is gone, no time is left, an object would not fit),
    else (per key the answer's code as a byte, the reply body when an answer is not OK or EXISTS, else None).
    ``written``: the bytes are already in the slab (write_tcp), with these xxh3_64 digests per key: only the ``put``
    is sent. Raises as get_many."""
    segment, region, slab_id = slab
    lists = type(addrs) is list and type(lens) is list and type(starts) is list and type(offsets) is list
    run = _mod().put_many_lists if lists else _mod().put_many
    addrs, lens, starts, offsets = _columns(lists, addrs, lens, starts, offsets)
    try:
        status, codes, body, _ = run(
            fd, rid, keys, addrs, lens, starts, segment, region, offsets, slab_id, write_ms, timeout_ms, maps, written
        )
    except ValueError as e:
        raise NativeError(str(e)) from e
    if status == 5:
        return None
    _raise_failed(status, body)
    return codes, body


def write_tcp(peers, addrs, lens, starts, segment: str, region: int, offsets, timeout_ms: float, land_by_ms: int):
    """Writes each key's spans (as put_many's) to ``offsets[k]`` of region ``region`` of segment ``segment`` (the
    master's name) over one idle pooled connection to the TCP peer ``peers`` (tcp_peers) routes it to, GIL
    released, within ``timeout_ms``, fenced at ``land_by_ms`` (unix ms: the peer drops bytes arriving later).
    Returns each key's xxh3_64 (an int list) once every byte was written; [] when a frame failed (bytes may be
    partly written, fenced); None when nothing was sent (no route or idle connection, an object past the region's
    end). Raises NativeError for
    spans not matching the keys."""
    lists = type(addrs) is list and type(lens) is list and type(starts) is list and type(offsets) is list
    run = _mod().write_tcp_lists if lists else _mod().write_tcp
    addrs, lens, starts, offsets = _columns(lists, addrs, lens, starts, offsets)
    try:
        return run(peers, addrs, lens, starts, segment, region, offsets, timeout_ms, land_by_ms)
    except ValueError as e:
        raise NativeError(str(e)) from e


def _columns(lists: bool, *cols) -> tuple:
    """Span columns for the native call: int lists as they are, else each as a uint64 array."""
    return cols if lists else tuple(np.ascontiguousarray(c, dtype=np.uint64) for c in cols)


def _raise_failed(status: int, why) -> None:
    """A native store op's failed exchange as TimeoutError (4) or ConnectionError (3): the one place these status
    codes become exceptions."""
    if status in (3, 4):
        raise (TimeoutError if status == 4 else ConnectionError)(why)


def ring_owners(keys: list[str], points, point_shard, shards: int) -> np.ndarray:
    """Each key's shard on a ring (store/cluster/ring.py: xxh3_64 of its UTF-8 bytes, the first point at or after
    it, wrapping), as a uint32 array of len(keys). ``points``: ascending uint64 positions; ``point_shard``: uint32
    index (< ``shards``) of each point's shard. Raises NativeError for a malformed ring, TypeError for a key that
    is not a str (or not UTF-8 encodable)."""
    try:
        owner = _mod().ring_owners(keys, np.ascontiguousarray(points), np.ascontiguousarray(point_shard), shards)
    except ValueError as e:
        raise NativeError(str(e)) from e
    return np.frombuffer(owner, dtype=np.uint32)


def shard_exists(fds: list[int], rids: list[int], keys: list[str], owner, timeout_ms: float):
    """A sharded store's ``exists`` in one native call, GIL released (native/src/store/shards.h): request ``rids[s]``
    sent on shard s's connected socket ``fds[s]`` with the keys ``owner`` (uint32 per key, ring_owners) gives it,
    every reply read in one poll loop (a shard that owns no key is not used: its fd may be -1). Returns (per key a
    uint8: 1 stored, 0 not, 2 its shard did not answer here; per shard: True (answered), None (none of the keys is
    on it), the reply body (bytes) for the caller to parse (a refusal), or the ConnectionError / TimeoutError of
    its connection, which is then not usable). Raises NativeError for an owner out of range, TypeError for a key
    that is not a str."""
    try:
        flags, per_shard = _mod().shard_exists(fds, rids, keys, np.ascontiguousarray(owner), float(timeout_ms))
    except ValueError as e:
        raise NativeError(str(e)) from e
    return np.frombuffer(flags, dtype=np.uint8), _shard_answers(per_shard)


def shard_call(fds: list[int], rids: list[int], op: str, keys: list[str], owner, timeout_ms: float) -> list:
    """Batch op ``op`` of a sharded store (``op`` [keys] {}) in one native fan-out, GIL released
    (native/src/store/shards.h), sent as shard_exists sends. Returns per shard: None (none of the keys is on it),
    the reply body (bytes: its payload answers that shard's keys in the caller's order), or the ConnectionError /
    TimeoutError of its connection, which is then not usable. Raises as shard_exists."""
    try:
        per_shard = _mod().shard_call(fds, rids, op, keys, np.ascontiguousarray(owner), float(timeout_ms))
    except ValueError as e:
        raise NativeError(str(e)) from e
    return _shard_answers(per_shard)


def _shard_answers(per_shard: list) -> list:
    """Per shard of a native fan-out: True (0: merged natively), the reply body (2), the exception of a failed
    exchange (3, 4) or None (5: not sent)."""
    out: list = []
    for status, value in per_shard:
        try:
            _raise_failed(status, value)
        except OSError as e:
            out.append(e)
        else:
            out.append(True if status == 0 else value if status == 2 else None)
    return out
