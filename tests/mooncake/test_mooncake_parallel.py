"""Mooncake 0.3.13's unified parallel tensor IO on our store (issue #19): the twelve *_tensor_with_parallelism*
methods, ParallelAxis / TensorParallelism / ReadTarget. ``mooncake_parallel_script`` also runs against a real
mooncake_master by tests/mooncake/mooncake_crosscheck.py (with Mooncake's own types): the keys, codes, tensors,
manifest bytes and the headers written into buffers below are Mooncake's."""

import struct
from types import SimpleNamespace

import numpy as np
import pytest

from helpers.cluster import store_cluster
from kvplugins import mooncake as compat
from kvplugins.mooncake import MooncakeDistributedStore
from kvplugins.mooncake.tensor_buffers import header


def mooncake_parallel_script(store, master: str, mc=compat) -> None:
    """``mc``: the module whose ParallelAxis, TensorParallelism, ReadTarget the script builds (ours or Mooncake's)."""
    import torch

    def ax(kind, rank, size, sd=None, eid=None, sid=None):
        a = mc.ParallelAxis()
        a.kind, a.rank, a.size, a.split_dim, a.expert_id, a.stage_id = kind, rank, size, sd, eid, sid
        return a

    def par(*axes):
        p = mc.TensorParallelism()
        p.axes = list(axes)
        return p

    def tgt(mode, p=None):
        t = mc.ReadTarget()
        t.mode, t.parallelism = mode, p
        return t

    def get(key, mode=None, *axes):
        return store.get_tensor_with_parallelism(key, None if mode is None else tgt(mode, par(*axes) if axes else None))

    def same(a, b) -> bool:
        return a is not None and a.shape == b.shape and torch.equal(a, b)

    def exist(*keys):
        return [store.is_exist(k) for k in keys]

    T = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert store.setup("localhost", "http://localhost:8080/metadata", 0, 16 << 20, "tcp", "", master) == 0
    # one TP axis: the tensor is the rank's shard
    assert store.put_tensor_with_parallelism("ra", T[0:2], par(ax("tp", 0, 2, 0))) == 0
    assert store.put_tensor_with_parallelism("ra", T[2:4], par(ax("TP", 1, 2, 0))) == 0
    assert exist("ra_tp_0", "ra_tp_1", "ra__parallelism_manifest", "ra") == [1, 1, 1, 0]
    assert bytes(store.get("ra__parallelism_manifest")) == struct.pack(
        "<IHHiiiii4x8q", 0x574D414E, 1, 96, 0, 2, 0, 2, 0, 4, 6, *[-1] * 6
    )
    assert get("ra") is None and get("ra", "full") is None
    assert same(get("ra", "shard", ax("tp", 0, 2, 0)), T[0:2]) and same(get("ra", "shard", ax("tp", 1, 2, 0)), T[2:4])
    assert same(get("ra", "shard", ax("tp", 1, 4, 0)), T[1:2]) and same(get("ra", "shard", ax("tp", 0, 1, 0)), T)
    assert same(get("ra", "full", ax("tp", 0, 2, 0)), T) and same(get("ra", "full", ax("tp", 1, 4, 0)), T)
    assert get("ra", "as_stored", ax("tp", 0, 2, 0)) is None and get("ra", "shard") is None
    assert get("ra", "full", ax("tp", 0, 2, 1)) is None
    assert same(store.get_tensor("ra_tp_1"), T[2:4])
    # a TP axis with others: the tensor is the whole one, the rank's slice is stored
    for r in (0, 1):
        assert store.put_tensor_with_parallelism("rd", T, par(ax("dp", 0, 2), ax("tp", r, 2, 1))) == 0
    assert exist("rd__dp_0of2__tp_0of2_sd1", "rd__dp_0of2__tp_1of2_sd1", "rd__parallelism_manifest") == [1, 1, 1]
    assert same(get("rd", "shard", ax("dp", 0, 2), ax("tp", 1, 2, 1)), T[:, 3:])
    assert same(get("rd", "shard", ax("tp", 1, 2, 1), ax("dp", 0, 2)), T[:, 3:])  # axes in any order
    assert same(get("rd", "shard", ax("dp", 0, 2), ax("tp", 1, 3, 1)), T[:, 2:4])  # another TP size
    assert same(get("rd", "full", ax("dp", 0, 2), ax("tp", 0, 2, 1)), T)
    assert get("rd", "shard", ax("dp", 1, 2), ax("tp", 1, 2, 1)) is None  # other DP rank: nothing
    assert get("rd", "full", ax("dp", 0, 2)) is None and get("rd", "full") is None
    assert store.put_tensor_with_parallelism("rp", T, par(ax("pp", 0, 2, sid=3), ax("tp", 1, 2, 0))) == 0
    assert exist("rp__tp_1of2_sd0__pp_0of2_sid3") == [1]
    # axes without TP: the whole tensor under the axes' key, no manifest
    assert store.put_tensor_with_parallelism("re", T, par(ax("ep", 1, 2, eid=4))) == 0
    assert exist("re__ep_1of2_eid4", "re__parallelism_manifest") == [1, 0]
    assert same(get("re", "shard", ax("ep", 1, 2, eid=4)), T) and get("re", "shard", ax("ep", 1, 2, eid=5)) is None
    assert store.put_tensor_with_parallelism("rq", T, par(ax("dp", 1, 2))) == 0 and exist("rq__dp_1of2") == [1]
    # writer partitions: the rank's slice of the whole tensor
    for r in (0, 1):
        w = SimpleNamespace(rank=r, size=2, split_dim=1)
        assert store.put_tensor_with_parallelism("rw", T, writer_partition=w) == 0
    assert exist("rw__writer_0of2_sd1", "rw__writer_1of2_sd1", "rw__writer_manifest") == [1, 1, 1]
    assert same(get("rw", "full"), T) and same(get("rw", "shard", ax("tp", 1, 2, 1)), T[:, 3:])
    assert get("rw") is None
    # refusals: -600
    bad = [
        (par(ax("tp", 2, 2, 0)), None),
        (par(ax("tp", 0, 2)), None),
        (par(ax("dp", 0, 2, 0)), None),
        (par(ax("ep", 0, 2)), None),
        (par(ax("pp", 0, 2)), None),
        (par(ax("dp", 0, 2), ax("dp", 1, 2)), None),
        (par(), None),
        (par(ax("xx", 0, 2)), None),
        (5, None),
        (par(ax("dp", 0, 2), ax("tp", 0, 4, 1)), None),
        (par(ax("tp", 0, 2, 0)), SimpleNamespace(rank=0, size=2, split_dim=0)),
        (None, SimpleNamespace(rank=0, size=4, split_dim=1)),
        (None, SimpleNamespace(rank=2, size=2, split_dim=0)),
    ]
    for p, w in bad:
        assert store.put_tensor_with_parallelism("bad", T, p, writer_partition=w) == -600, (p, w)
    assert store.put_tensor_with_parallelism("bad", [1, 2]) == -600 and exist("bad") == [0]
    # put keeps a stored key, upsert replaces it
    assert store.put_tensor_with_parallelism("ra", T[0:2] + 100, par(ax("tp", 0, 2, 0))) == 0
    assert same(get("ra", "shard", ax("tp", 0, 2, 0)), T[0:2])
    assert store.upsert_tensor_with_parallelism("ra", T[0:2] + 100, par(ax("tp", 0, 2, 0))) == 0
    assert same(get("ra", "shard", ax("tp", 0, 2, 0)), T[0:2] + 100)
    assert store.upsert_tensor_with_parallelism("ra", T[0:2], par(ax("tp", 0, 2, 0))) == 0
    # batches
    assert store.batch_put_tensor_with_parallelism(
        ["b1", "b2", "b3"], [T, T, T], [par(ax("tp", 0, 2, 0)), None, par(ax("tp", 5, 2, 0))]
    ) == [0, 0, -600]
    assert exist("b1_tp_0", "b2") == [1, 1]
    assert store.batch_put_tensor_with_parallelism(["b6", "b7"], [T, [1]]) == [0, -600]  # per item
    assert store.batch_put_tensor_with_parallelism(["b4", "b5"], [T, T], (None, None)) == [-600, -600]
    assert store.batch_put_tensor_with_parallelism(["b4", "b5"], [T, T], [None]) == [-600, -600]
    assert store.batch_upsert_tensor_with_parallelism(
        ["b2"], [T + 1], None, writer_partitions=[SimpleNamespace(rank=0, size=2, split_dim=0)]
    ) == [0]
    assert exist("b2__writer_0of2_sd0") == [1]
    got = store.batch_get_tensor_with_parallelism(
        ["ra", "re", "nope"], [tgt("shard", par(ax("tp", 1, 2, 0))), tgt("shard", par(ax("ep", 1, 2, eid=4))), None]
    )
    assert same(got[0], T[2:4]) and same(got[1], T) and got[2] is None
    assert store.batch_get_tensor_with_parallelism(["ra"], (tgt("full"),)) == [None]
    # caller buffers in Mooncake's layout
    buf = np.zeros(1 << 16, np.uint8)
    base = buf.ctypes.data
    assert store.register_buffer(base, buf.nbytes) == 0
    blob = header(T) + T.numpy().tobytes()
    buf[: len(blob)] = np.frombuffer(blob, np.uint8)
    assert store.put_tensor_with_parallelism_from("rf", base, len(blob), par(ax("tp", 0, 2, 1))) == 0
    assert exist("rf_tp_0", "rf_tp_1", "rf__parallelism_manifest") == [1, 1, 0]  # every rank, no manifest
    assert same(get("rf", "shard", ax("tp", 1, 2, 1)), T[:, 3:]) and same(get("rf", "full", ax("tp", 0, 2, 1)), T)
    assert store.put_tensor_with_parallelism_from("rf2", base, len(blob) + 1, par(ax("tp", 0, 2, 1))) == -600
    assert store.batch_upsert_tensor_with_parallelism_from(
        ["rf3", "rf4"], [base, base], [len(blob)] * 2, [par(ax("dp", 1, 2)), par(ax("tp", 3, 2, 0))]
    ) == [0, -600]
    assert exist("rf3__dp_1of2") == [1]
    assert store.batch_put_tensor_with_parallelism_from(
        ["rf5"], [base], [len(blob)], writer_partitions=[SimpleNamespace(rank=1, size=2, split_dim=0)]
    ) == [0]
    assert exist("rf5__writer_1of2_sd0", "rf5__writer_manifest") == [1, 1]
    blob2 = header(T + 1) + (T + 1).numpy().tobytes()
    buf[4096 : 4096 + len(blob2)] = np.frombuffer(blob2, np.uint8)
    assert store.upsert_tensor_with_parallelism_from("rf", base + 4096, len(blob2), par(ax("tp", 0, 2, 1))) == 0
    assert same(get("rf", "shard", ax("tp", 1, 2, 1)), (T + 1)[:, 3:])
    dst = base + 8192
    for key, target, want, meta in (
        ("ra", tgt("shard", par(ax("tp", 0, 2, 0))), T[0:2], {"g": [4, 6], "axes": [["tp", 0, 2, 0, 0]]}),
        ("ra", tgt("full", par(ax("tp", 0, 2, 0))), T, None),
        ("ra", tgt("shard", par(ax("tp", 1, 4, 0))), T[1:2], {"g": [4, 6], "axes": [["tp", 1, 4, 0, 0]]}),
        ("re", tgt("shard", par(ax("ep", 1, 2, eid=4))), T, {"g": [4, 6], "axes": [["ep", 1, 2, -1, 4]]}),
    ):
        out = store.get_tensor_with_parallelism_into(key, dst, 4096, target)
        assert same(out, want) and out.data_ptr() == dst + 304, (key, want.shape)
        assert bytes(buf[8192 : 8192 + 304]) == header(want, meta), (key, want.shape)
    assert store.get_tensor_with_parallelism_into("ra", dst, 300, tgt("full", par(ax("tp", 0, 2, 0)))) is None
    loose = np.zeros(4096, np.uint8)  # not registered
    assert store.get_tensor_with_parallelism_into("ra", loose.ctypes.data, 4096, None) is None
    outs = store.batch_get_tensor_with_parallelism_into(
        ["ra", "nope"], [dst, dst + 4096], [4096, 4096], [tgt("full", par(ax("tp", 0, 2, 0))), None]
    )
    assert same(outs[0], T) and outs[1] is None
    B = torch.arange(32, dtype=torch.float32).reshape(4, 8).to(torch.bfloat16).t()  # bf16, non-contiguous
    for r in (0, 1):
        assert store.put_tensor_with_parallelism("rb", B, par(ax("pp", 1, 2, sid=0), ax("tp", r, 2, 0))) == 0
    assert same(get("rb", "full", ax("pp", 1, 2, sid=0), ax("tp", 0, 2, 0)), B.contiguous())
    out = store.get_tensor_with_parallelism_into(
        "rb", dst, 4096, tgt("shard", par(ax("pp", 1, 2, sid=0), ax("tp", 1, 2, 0)))
    )
    assert same(out, B[4:].contiguous()) and out.dtype == torch.bfloat16
    assert bytes(buf[8192 : 8192 + 304]) == header(
        B[4:].contiguous(), {"g": [8, 4], "axes": [["pp", 1, 2, -1, 0], ["tp", 1, 2, 0, 0]]}
    )
    assert store.put_tensor_with_tp("lg", T, 0, 2, 0) == 0  # the TP forms' shards are described too
    assert same(store.get_tensor_with_tp_into("lg", dst, 4096, 1, 2, 0), T[2:])
    assert bytes(buf[8192 : 8192 + 304]) == header(T[2:], {"g": [4, 6], "axes": [["tp", 1, 2, 0, 0]]})
    assert same(get("lg", "full", ax("tp", 0, 2, 0)), T)
    assert store.unregister_buffer(base) == 0
    assert store.remove_all(True) > 20
    assert store.close() == 0


def test_parallel_script_runs_on_our_store():
    with store_cluster(nodes=1, segment_size="8MiB") as c:
        mooncake_parallel_script(MooncakeDistributedStore(), c.master)


def test_types_behave_as_mooncakes():
    with pytest.raises(TypeError):
        compat.ParallelAxis(kind="tp")
    a = compat.ParallelAxis()
    assert (a.kind, a.rank, a.size, a.split_dim, a.expert_id, a.stage_id) == ("", 0, 1, None, None, None)
    for field, value in (("kind", 1), ("rank", "1"), ("size", 1.5), ("split_dim", 1 << 40)):
        with pytest.raises(TypeError):
            setattr(a, field, value)
    p = compat.TensorParallelism()
    p.axes.append(a)  # a copy: lost, as on Mooncake
    assert p.axes == []
    p.axes = (a,)
    assert p.axes == [a]
    with pytest.raises(TypeError):
        p.axes = [1]
    t = compat.ReadTarget()
    assert t.mode == "as_stored" and t.parallelism is None
    t.mode = "FULL"
    assert t.mode == "full"
    with pytest.raises(RuntimeError):
        t.mode = "mixed"
    with pytest.raises(TypeError):
        t.parallelism = [a]


def test_a_contradicting_shard_is_a_miss_not_the_wrong_bytes():
    """Mooncake 0.3.13 answers a one-TP-axis shard read whose split_dim or TP size contradicts the stored shards
    with ``{key}_tp_{rank}`` anyway; here it is None (docs/store.md)."""
    import torch

    T = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    with store_cluster(nodes=1, segment_size="8MiB") as c:
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "", 0, 16 << 20, "tcp", "", c.master) == 0
        p, tp = compat.TensorParallelism(), compat.ParallelAxis()
        tp.kind, tp.rank, tp.size, tp.split_dim = "tp", 0, 2, 0
        p.axes = [tp]
        assert store.put_tensor_with_parallelism("w", T[0:2], p) == 0
        for size, sd in ((2, 1), (3, 0), (4, 0)):  # another split_dim, a size that does not divide, r1 missing
            tp.size, tp.split_dim = size, sd
            p.axes = [tp]
            t = compat.ReadTarget()
            t.mode, t.parallelism = "shard", p
            assert store.get_tensor_with_parallelism("w", t) is None, (size, sd)
        assert store.close() == 0


def test_the_mooncake_shim_exports_these_types_under_mooncakes_names(tmp_path):
    """`kvplugins mooncake enable`: `from mooncake.store import ParallelAxis, TaskStatus, ...` gives ours, and every
    name the shim exports is one the real 0.3.13 module has."""
    from helpers.shims import shim_probe
    from kvplugins.mooncake import shim as mooncake_shim

    real = pytest.importorskip("mooncake.store")
    probe = "import mooncake.store as m; print(m.MooncakeDistributedStore.__module__, *m.__all__)"
    out = shim_probe(mooncake_shim.SHIM, tmp_path, probe)
    assert out[0] == "kvplugins.mooncake.api"
    assert set(out[1:]) <= set(dir(real))
    assert {
        "ParallelAxis",
        "TensorParallelism",
        "ReadTarget",
        "TaskStatus",
        "TaskType",
        "QueryTaskResponse",
        "ReplicaStatus",
        "ReplicateConfig",
    } <= set(out[1:])
