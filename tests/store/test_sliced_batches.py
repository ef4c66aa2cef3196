"""Batches past batches.SLICE_KEYS run in slices (master/batches.py) and answer exactly what the unsliced op
answers: per-entry lists in order, a get's column answer re-indexed over segments, per-entry checksums cut to
each slice, a mismatched checksum list refused before anything is applied."""

import pytest

from kvplugins.store.config import MasterConfig
from kvplugins.store.master import batches
from kvplugins.store.master.service import MasterService
from kvplugins.store.wire.protocol import OK

N = 3 * batches.SLICE_KEYS + 7


def service() -> MasterService:
    svc = MasterService(MasterConfig(alloc_align=64))
    for name in ("a", "b", "c"):
        wire = {"v": 1, "segment_id": name, "host_id": "h", "transports": {}, "regions": [[1, 1 << 20, None]]}
        assert svc.handle("register_segment", [[wire, 1, 1 << 20]], {})[0][0] == OK
    return svc


def test_sliced_answers_equal_unsliced(monkeypatch):
    """Reads answer the same sliced and whole on one table; sliced writes apply every entry (put_start's
    placement rotates per slice, so its locations are checked against what get answers instead)."""
    keys = [f"k{i}" for i in range(N)]
    svc = service()
    placed = svc.handle("put_start", [[k, 100] for k in keys], {"replicas": 2})
    assert len(placed) == N and all(code == OK and len(locs) == 2 for code, locs in placed)
    assert svc.handle("put_commit", keys, {"xxh3": list(range(N))}) == [[OK, None]] * N
    reads = [
        ("get", keys + ["missing"], {"cols": 1}),
        ("get", keys, {}),
        ("exists", keys + ["missing"], {}),
        ("get_size", keys, {}),
    ]
    sliced = [svc.handle(op, entries, opts) for op, entries, opts in reads]
    monkeypatch.setattr(batches, "SLICE_KEYS", 10 * N)
    assert [svc.handle(op, entries, opts) for op, entries, opts in reads] == sliced
    ttl, sizes, names, regions, idx, offs, more, sums, disk = sliced[0]
    assert sizes[-1] == -1 and idx[-1] == -1 and sorted(more) == list(range(N)) and sums[:N] == list(range(N))
    assert [more[j] for j in range(N)] == [locs for _, locs in placed]
    assert [answer[1][1] for answer in sliced[1]] == [locs for _, locs in placed]


def test_mismatched_checksums_refused_before_any_slice():
    svc = service()
    keys = [f"k{i}" for i in range(N)]
    svc.handle("put_start", [[k, 100] for k in keys], {})
    with pytest.raises(ValueError, match=f"xxh3 has {N - 1} checksums for {N} keys"):
        svc.handle("put_commit", keys, {"xxh3": list(range(N - 1))})
    assert svc.handle("status", [], {})["pending"] == N


def test_pending_puts_and_segments_are_bounded():
    """max_pending_puts: put_start past it answers StoreFull for the entries over; max_segments and 64 segments
    per process (owner token) bound the registry (issue #30 item 3)."""
    from kvplugins.store.master.segments import MAX_PER_OWNER
    from kvplugins.store.wire.protocol import STORE_FULL

    svc = MasterService(MasterConfig(alloc_align=64, max_pending_puts=1000, max_segments=MAX_PER_OWNER + 2))

    def reg(name, owner):
        wire = {"v": 1, "segment_id": name, "host_id": "h", "transports": {}, "regions": [[1, 1 << 20, None]]}
        return svc.handle("register_segment", [[wire, 1, 1 << 20]], {"owner": owner})[0]

    assert all(reg(f"s{i}", "one")[0] == OK for i in range(MAX_PER_OWNER))
    code, why = reg("extra", "one")
    assert code == STORE_FULL and f"{MAX_PER_OWNER} segments" in why
    assert reg("other", "two")[0] == OK and reg("s0", "one")[0] == OK  # re-registering is no new one
    assert reg("third", "three")[0] == OK
    code, why = reg("fourth", "four")
    assert code == STORE_FULL and "max_segments" in why
    out = svc.handle("put_start", [[f"k{i}", 64] for i in range(900)], {})
    assert all(code == OK for code, _ in out)
    out = svc.handle("put_start", [[f"m{i}", 64] for i in range(200)], {})
    assert [code for code, _ in out] == [OK] * 100 + [STORE_FULL] * 100 and "max_pending_puts" in out[-1][1]
    svc.handle("put_commit", [f"k{i}" for i in range(900)], {})
    assert svc.handle("put_start", [["later", 64]], {})[0][0] == OK
