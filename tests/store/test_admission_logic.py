"""Admission (master/admission.py, issue #30 item 3) in MasterService with a fake prober and clock: a segment
registered while a prober is installed gets no placement until its probe succeeded, a failed probe answers
UNREACHABLE naming why and removes it, and the probe block of a segment coming back for its manifest never
overlaps an object it gets back. tests/security/test_admission.py does it with real processes."""

from concurrent.futures import Future

from test_liveness import Clock, put, reg, silence

from kvplugins.store.config import MasterConfig
from kvplugins.store.master import batches
from kvplugins.store.master.service import MasterService
from kvplugins.store.wire.protocol import OK, UNREACHABLE


class FakeProber:
    def __init__(self):
        self.probes: list[tuple] = []  # (segment id, offset, bytes, Future)

    def submit(self, wire, region_id, offset, nbytes):
        fut = Future()
        self.probes.append((wire["segment_id"], offset, nbytes, fut))
        return fut


def service() -> MasterService:
    m = MasterService(
        MasterConfig(
            heartbeat_timeout_ms=2000, suspect_grace_ms=10000, lease_ttl_ms=1000, put_timeout_ms=2000, alloc_align=64
        ),
        clock=Clock(),
    )
    return m


def register_probed(m, seg_id: str, size: int, owner: str = "owner-a") -> batches.Deferred:
    wire = {"v": 1, "segment_id": seg_id, "host_id": "h", "transports": {}, "regions": [[1, size, None]]}
    answer = m.handle("register_segment", [[wire, 1, size]], {"owner": owner}, defer=True)
    assert isinstance(answer, batches.Deferred) and answer.waiting and not m.step(answer)
    return answer


def test_no_placement_before_the_probe_succeeds_and_a_failed_probe_removes_the_segment():
    m = service()
    (_, small) = reg(m, "small", 64 << 10)  # no prober yet: admitted at once
    m.prober = FakeProber()
    big = register_probed(m, "big", 1 << 30)
    assert {put(m, f"k{i}")[0][0] for i in range(20)} == {small}  # the bigger one is not placed on yet
    bad = register_probed(m, "bad", 1 << 30)
    assert [p[0] for p in m.prober.probes] == ["big", "bad"] and m.prober.probes[0][2] == 4096
    m.prober.probes[0][3].set_result(None)
    m.prober.probes[1][3].set_result("tcp peer 10.0.0.9:1 refused the connection")
    assert m.step(big) and big.result == [[OK, "big:1"]]
    assert m.step(bad) and bad.result[0][0] == UNREACHABLE and "10.0.0.9:1 refused" in bad.result[0][1]
    assert put(m, "after")[0][0] == "big:1"  # admitted: the most free space
    st = m.handle("status", [], {})
    assert sorted(s["name"] for s in st["segments"]) == ["big:1", "small:1"] and st["segments_refused"] == 1
    assert st["segments_lost"] == 0  # refused, never admitted: nothing was lost
    assert m.segments.get("big:1").used == 128  # the probe block was freed (one 100 B object)


def test_a_returning_segments_probe_never_overwrites_what_it_gets_back():
    m = service()
    (_, name) = reg(m, "s", 4096)
    objs = {put(m, f"k{i}", 1000)[0][1]: f"k{i}" for i in range(3)}  # offsets 0, 1024, 2048
    silence(m, 13)  # past the grace: removed, manifest kept
    assert m.handle("status", [], {})["manifest_objects"] == 3
    m.prober = FakeProber()
    back = register_probed(m, "s", 4096)
    [(_, offset, nbytes, fut)] = m.prober.probes
    assert (offset, nbytes) == (3072, 1024)  # the one free KiB, not over an object
    assert all(not (o < offset + nbytes and offset < o + 1000) for o in objs)
    fut.set_result(None)
    assert m.step(back) and back.result == [[OK, name]]
    assert all(m.handle("get", [k], {})[0][0] == OK for k in objs.values())


def test_a_segment_coming_back_full_of_its_objects_is_admitted_unprobed():
    m = service()
    (_, name) = reg(m, "s", 4096)
    keys = [f"k{i}" for i in range(4) if put(m, f"k{i}", 1024, pin=2)]  # hard-pinned: never evicted
    silence(m, 13)
    m.prober = FakeProber()
    assert reg(m, "s", 4096) == [OK, name] and m.prober.probes == []  # admitted before, by the same process
    assert all(m.handle("get", [k], {})[0][0] == OK for k in keys)
