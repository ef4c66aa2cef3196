"""The master's native object table (kvplugins._meta behind master/metadata.py, issue #18 part 2): checked
against a plain-Python model under random operations, stale views, the allocator's size map, and the memory
per object the issue asks for (no processes; the 2 M-object check runs in a child process for a clean RSS)."""

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplugins._meta import SizeMap
from kvplugins.store.master.metadata import ObjectTable

KEYS = st.sampled_from([f"k{i}" for i in range(40)] + ["", "é/ü", "x" * 300])
OPS = st.lists(
    st.tuples(
        st.sampled_from(["new", "commit", "touch", "remove", "pin", "unpin", "park", "unpark", "replicas"]),
        KEYS,
        st.integers(0, 3),
    ),
    max_size=300,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_table_matches_a_python_model(ops):
    """Membership, fields, LRU order per list, per-segment counts and pending set agree with an OrderedDict
    model after every operation."""
    t, model, now = ObjectTable(), {}, 0.0  # model: key -> dict(fields); order = list order per list
    order = {0: [], 1: [], 2: []}

    def move(key, lst):
        for v in order.values():
            if key in v:
                v.remove(key)
        order[lst].append(key)

    for op, key, n in ops:
        now += 1.0
        obj = t.get(key)
        assert (obj is not None) == (key in model) == (key in t)
        if op == "new" and key not in model:
            reps = [(f"s{j}", 64 * j + n) for j in range(n % 3)]
            t.new(key, n * 10, reps, deadline=now + 5, last_access=now, pin=2 if n == 3 else 0)
            model[key] = {"size": n * 10, "replicas": reps, "complete": False, "pin": 2 if n == 3 else 0}
            move(key, 1 if n == 3 else 0)
        elif obj is None:
            continue
        elif op == "commit" and not model[key]["complete"]:
            t.commit(obj, now)
            model[key]["complete"] = True
            move(key, next(lst for lst, v in order.items() if key in v))
            assert obj.born == now and obj.last_access == now
        elif op == "touch":
            t.touch(obj, now)
            move(key, next(lst for lst, v in order.items() if key in v))
        elif op == "remove":
            t.remove(obj)
            del model[key]
            for v in order.values():
                if key in v:
                    v.remove(key)
            with pytest.raises(RuntimeError, match="stale object view"):
                obj.size
        elif op == "unpin":
            t.unpin(obj)
            if key in order[1]:
                move(key, 0)
            model[key]["pin"] = 0
        elif op == "park":
            t.park(obj)
            move(key, 2)
        elif op == "unpark" and key in order[2]:
            t.unpark(obj, now)
            move(key, 1 if model[key]["pin"] else 0)
        elif op == "replicas":
            reps = [(f"s{(n + j) % 3}", 4096 * j) for j in range(n)]
            obj.replicas = reps
            model[key]["replicas"] = reps
    assert len(t) == len(model)
    for key, want in model.items():
        obj = t.get(key)
        assert (obj.key, obj.size, obj.replicas, obj.complete, obj.pin) == (
            key,
            want["size"],
            want["replicas"],
            want["complete"],
            want["pin"],
        )
    assert [o.key for o in t.iter_lru()] == order[0]
    assert [o.key for o in t.iter_lru_newest()] == order[0][::-1]
    assert [o.key for o in t.iter_pinned()] == order[1]
    assert [o.key for o in t.lru()] == order[0] + order[1] + order[2]
    assert sorted(o.key for o in t.pending()) == sorted(k for k, v in model.items() if not v["complete"])
    for seg in ("s0", "s1", "s2"):
        holders = sorted(k for k, v in model.items() if any(n == seg for n, _ in v["replicas"]))
        assert t.count_on(seg) == sum(n == seg for v in model.values() for n, _ in v["replicas"])
        assert sorted(o.key for o in t.on_segment(seg)) == holders
    assert t.exists(list(model) + ["never"]) == [v["complete"] for v in model.values()] + [False]


def test_batch_get_leases_touches_and_reports_columns():
    t = ObjectTable()
    t.set_region("seg:1", 7)
    a = t.new("a", 100, [("seg:1", 0)], complete=True, born=1.0, last_access=1.0, checksum=2**64 - 1)
    t.new("b", 50, [("seg:1", 128), ("seg:2", 0)], complete=True, last_access=1.0)
    t.new("p", 10, [("seg:1", 256)], deadline=9.0)  # pending: a miss
    t.new("d", 10, [], complete=True)  # disk only: listed for the tier
    hits, sizes, names, regions, seg_idx, offs, more, sums, disk = t.get_cols(["b", "p", "a", "zz", "d"], 5.0, 8.0)
    assert hits == 2 and sizes == [50, -1, 100, -1, -1] and names == ["seg:1"] and regions == [7]
    assert seg_idx == [0, -1, 0, -1, -1] and offs == [128, 0, 0, 0, 0] and sums == [None, None, 2**64 - 1, None, None]
    assert [(j, o.key) for j, o in more] == [(0, "b")] and [(j, o.key) for j, o in disk] == [(4, "d")]
    assert more[0][1].locations == [["seg:1", 7, 128], ["seg:2", -1, 0]]
    assert a.lease_until == 8.0 and a.last_access == 5.0
    assert [o.key for o in t.iter_lru_newest()][:2] == ["a", "b"]  # hits touched, in batch order
    assert t.exists_prefix(["a", "b", "p", "a"]) == 2


def test_views_compare_by_record_and_generation():
    t = ObjectTable()
    a = t.new("k", 1, [])
    assert t.get("k") == a and t.get("k") is not a
    t.remove(a)
    b = t.new("k", 2, [])  # may reuse the record: a different generation
    assert b != a and not a.alive() and b.alive()
    with pytest.raises(KeyError):
        t.new("k", 3, [])
    # a key gone compares unequal, whichever side None is on: ``table.get(key) != obj`` raised TypeError here
    # (nanobind refused None), and the master's tick failed on every sweep from the first removed key in its
    # repair queue or replica tasks on, so re-replication stopped (the 60 s SIGSTOP cluster run, issue #34)
    t.remove(b)
    assert t.get("k") is None and t.get("k") != b and b != t.get("k") and not (b == None)  # noqa: E711


def test_size_map_against_a_dict():
    import random

    rng, m, ref = random.Random(3), SizeMap(64), {}
    for _ in range(20000):
        off = rng.randrange(5000) * 64
        if off in ref and rng.random() < 0.5:
            assert m.pop(off) == ref.pop(off)
        else:
            ref[off] = m[off] = rng.randrange(1, 1000) * 64
    assert len(m) == len(ref) and all(m[o] == s for o, s in ref.items())
    with pytest.raises(KeyError):
        m.pop(64 * 5001)
    with pytest.raises(ValueError, match="multiple of the alignment 64"):
        m[0] = 65


CHILD = """
import json, sys
sys.argv = ["master_scale"]
from benchmarks import master_scale
print(json.dumps(master_scale.measure(2_000_000, 1000, 48)))
"""


@pytest.mark.slow
def test_two_million_objects_fit_the_memory_budget():
    """Issue #18: about 200 B per object including the LRU, the index and the allocator's map (48-byte keys).
    10 M objects (178 B each, docs/benchmarks.md) take 75 s and 3 GB here: benchmarks/master_scale.py."""
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True, timeout=300)
    r = json.loads(out.stdout)
    assert r["bytes_per_object"] <= 220, r
