"""kvplugins.mooncake.api.MooncakeDistributedStore: the method names, parameter names/order, defaults and return
types of the installed Mooncake (0.3.13, read from its pybind signatures), a Mooncake-style script run against
our real store processes with Mooncake's documented return codes, and the admin ops behind it."""

import re
import time

import numpy as np
import pytest

from helpers.cluster import store_cluster
from kvplugins import mooncake as compat
from kvplugins.mooncake import MooncakeDistributedStore, ReplicateConfig
from kvplugins.store.client.connect import control_client

METHODS = (
    "setup",
    "close",
    "put",
    "get",
    "put_batch",
    "get_batch",
    "put_from",
    "get_into",
    "batch_put_from",
    "batch_get_into",
    "register_buffer",
    "unregister_buffer",
    "is_exist",
    "batch_is_exist",
    "get_size",
    "remove",
    "remove_by_regex",
    "remove_all",
    "get_hostname",
    "health_check",
    "batch_remove",
    "upsert",
    "upsert_batch",
    "upsert_from",
    "batch_upsert_from",
    "put_parts",
    "upsert_parts",
    "get_buffer",
    "batch_get_buffer",
    "put_tensor",
    "batch_put_tensor",
    "pub_tensor",
    "batch_pub_tensor",
    "upsert_tensor",
    "batch_upsert_tensor",
    "upsert_pub_tensor",
    "batch_upsert_pub_tensor",
    "get_tensor",
    "batch_get_tensor",
    "save_tensor_to_safetensor",
    "load_tensor_from_safetensor",
    "batch_put_from_multi_buffers",
    "batch_get_into_multi_buffers",
    "put_tensor_with_tp",
    "pub_tensor_with_tp",
    "batch_put_tensor_with_tp",
    "batch_pub_tensor_with_tp",
    "get_tensor_with_tp",
    "batch_get_tensor_with_tp",
    "batch_put_session_start",
    "batch_put_from_multi_buffer_ranges",
    "batch_put_session_end",
    "batch_put_session_revoke",
    "batch_get_session_start",
    "batch_get_into_multi_buffer_ranges",
    "batch_get_session_end",
    "get_replica_desc",
    "batch_get_replica_desc",
    "batch_replica_clear",
    "put_from_with_metadata",
    "get_into_ranges",
    "put_tensor_from",
    "batch_put_tensor_from",
    "upsert_tensor_from",
    "batch_upsert_tensor_from",
    "get_tensor_into",
    "batch_get_tensor_into",
    "put_tensor_with_tp_from",
    "batch_put_tensor_with_tp_from",
    "get_tensor_with_tp_into",
    "batch_get_tensor_with_tp_into",
    "create_copy_task",
    "create_move_task",
    "query_task",
    "put_tensor_with_parallelism",
    "put_tensor_with_parallelism_from",
    "batch_put_tensor_with_parallelism",
    "batch_put_tensor_with_parallelism_from",
    "upsert_tensor_with_parallelism",
    "upsert_tensor_with_parallelism_from",
    "batch_upsert_tensor_with_parallelism",
    "batch_upsert_tensor_with_parallelism_from",
    "get_tensor_with_parallelism",
    "get_tensor_with_parallelism_into",
    "batch_get_tensor_with_parallelism",
    "batch_get_tensor_with_parallelism_into",
)
SIG = re.compile(r"^\s*(?:\d+\. )?(\w+)\(self: [\w.]+(.*)\) -> (.+)$", re.M)


def mooncake_signature(fn) -> tuple[list[tuple[str, str | None]], str]:
    """([(param name, default text or None)], return type) from a pybind docstring (first overload)."""
    name, params, ret = SIG.findall(fn.__doc__)[0]
    out = []
    for p in filter(None, (x.strip() for x in re.split(r", (?![^\[]*\])", params))):  # not inside [...]
        head, _, default = p.partition(" = ")
        out.append((head.split(":")[0], default or None))
    return out, ret.strip()


@pytest.mark.parametrize("method", METHODS)
def test_signature_matches_installed_mooncake(method):
    import inspect

    mc = pytest.importorskip("mooncake.store")
    theirs, their_ret = mooncake_signature(getattr(mc.MooncakeDistributedStore, method))
    sig = inspect.signature(getattr(MooncakeDistributedStore, method))
    ours = [p for p in sig.parameters.values() if p.name != "self"]
    assert len(ours) == len(theirs), (method, [p.name for p in ours], theirs)
    for p, (name, default) in zip(ours, theirs):
        if name == "*args":
            assert p.kind == p.VAR_POSITIONAL, (method, p)
        elif p.kind == p.KEYWORD_ONLY:  # after *args, as in pybind
            assert p.name == name, (method, p.name, name)
        elif name.startswith("arg"):  # pybind positional: ours must be positional too
            assert p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD), (method, p)
        else:
            assert p.name == name and p.kind == p.POSITIONAL_OR_KEYWORD, (method, p.name, name)
        if default is not None:
            assert p.default is not p.empty, (method, name)
            if default[0] not in "<":  # literal defaults must be equal
                assert repr(p.default) == default or str(p.default) == default, (method, name, p.default, default)
    ret = re.sub(r"\b(BufferHandle|ReplicaDescriptor)\b", r"mooncake.store.\1", sig.return_annotation)
    assert ret == their_ret, (method, sig.return_annotation, their_ret)


def test_replicate_config_has_mooncake_attributes_and_defaults():
    mc = pytest.importorskip("mooncake.store")
    theirs, ours = mc.ReplicateConfig(), ReplicateConfig()
    names = [a for a in dir(theirs) if not a.startswith("_")]
    assert "replica_num" in names and "with_hard_pin" in names
    for name in names:
        want, got = getattr(theirs, name), getattr(ours, name)
        want = int(want) if hasattr(want, "__int__") and not isinstance(want, (bool, int)) else want
        assert got == want, (name, got, want)


PROBES = [True, 0, 1, -1, 2, 2**63, 2**64, 1.0, "2", None, ["a"], ("a",), "ab", [1], {}]


def test_replicate_config_assignment_types_match_mooncake():
    """Every attribute, assigned each probe value on Mooncake's ReplicateConfig and on ours: the same TypeError,
    or the same value read back (issue #19: Mooncake's binding refuses what it cannot convert)."""
    mc = pytest.importorskip("mooncake.store")
    from kvplugins.mooncake import ObjectDataType, SoftPinAction

    np = pytest.importorskip("numpy")
    names = [a for a in dir(mc.ReplicateConfig()) if not a.startswith("_")]
    pairs = [(v, v) for v in PROBES + [np.int64(3), np.True_]]
    pairs += [(mc.SoftPinAction.ENABLE, SoftPinAction.ENABLE), (mc.ObjectDataType.TENSOR, ObjectDataType.TENSOR)]
    for name in names:
        for theirs_value, ours_value in pairs:
            theirs, ours = mc.ReplicateConfig(), ReplicateConfig()
            try:
                setattr(theirs, name, theirs_value)
                want = getattr(theirs, name)
            except TypeError:
                want = TypeError
            try:
                setattr(ours, name, ours_value)
                got = getattr(ours, name)
            except TypeError:
                got = TypeError
            if want is not TypeError and hasattr(want, "name") and hasattr(want, "value"):  # their enum
                want = int(want.value)
            assert (got if got is TypeError or isinstance(got, (list, type(None), str)) else int(got)) == want, (
                name,
                theirs_value,
                got,
                want,
            )
    with pytest.raises(AttributeError):
        ReplicateConfig().no_such_attribute = 1


def mooncake_style_script(store, master: str) -> None:
    """Code written for mooncake.store. Every expected value is what a real mooncake_master 0.3.13 + two
    segment processes answered to this same script (run once by hand inside a private network namespace,
    2026-11-21: Mooncake binds 0.0.0.0, so it cannot run in CI here). The master's lease must outlast the script
    (Mooncake's default lease is 5 s, like ours)."""
    assert store.setup("localhost", "http://localhost:8080/metadata", 0, 16 * 1024 * 1024, "tcp", "", master) == 0
    assert store.put("hello_key", b"Hello, Mooncake Store!") == 0
    assert store.put("hello_key", b"Hello, Mooncake Store!") == 0  # existing key: no-op success
    assert store.get("hello_key") == b"Hello, Mooncake Store!"
    assert store.get("absent") == b""
    assert (store.is_exist("hello_key"), store.is_exist("absent")) == (1, 0)
    assert (store.get_size("hello_key"), store.get_size("absent")) == (22, -704)
    config = ReplicateConfig()
    config.replica_num = 2
    assert store.put("important_data", b"Critical information" * 50, config) == 0
    keys, values = ["key1", "key2", "key3"], [b"value1", b"value2", b"value3" * 1000]
    assert store.put_batch(keys, values) == 0
    assert store.get_batch(keys + ["absent"]) == values + [b""]
    assert store.batch_is_exist(keys + ["absent"]) == [1, 1, 1, 0]

    buf = np.zeros(1 << 20, dtype=np.uint8)
    src, dst = buf.ctypes.data, buf.ctypes.data + (512 << 10)
    buf[: 3 * 4096] = np.random.default_rng(1).integers(0, 256, 3 * 4096, dtype=np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    assert store.put_from("zc/0", src, 4096) == 0
    assert store.batch_put_from(["zc/1", "zc/2"], [src + 4096, src + 8192], [4096, 4096]) == [0, 0]
    assert store.get_into("zc/0", dst, 64 * 1024) == 4096  # capacity >= size: bytes read
    assert np.array_equal(buf[512 << 10 : (512 << 10) + 4096], buf[:4096])
    assert store.get_into("zc/0", dst, 100) == -600  # buffer too small
    assert store.get_into("absent", dst, 4096) == -704
    assert store.batch_get_into(["zc/1", "zc/2", "absent"], [dst, dst + 4096, dst + 8192], [4096] * 3) == [
        4096,
        4096,
        -704,
    ]
    assert np.array_equal(buf[512 << 10 : (512 << 10) + 8192], buf[4096 : 3 * 4096])
    assert store.unregister_buffer(buf.ctypes.data) == 0
    assert store.unregister_buffer(buf.ctypes.data) < 0
    assert store.put_from("zc/3", src, 4096) == 0  # unregistered memory: copied
    buf[(512 << 10) : (512 << 10) + 4096] = 0
    assert store.get_into("zc/0", dst, 4096) == 4096  # into unregistered memory too
    assert np.array_equal(buf[512 << 10 : (512 << 10) + 4096], buf[:4096])

    assert store.remove("hello_key") == -706  # read above: its lease runs (OBJECT_HAS_LEASE)
    assert store.remove("absent") == -704
    assert store.remove("hello_key", True) == 0  # force
    assert store.remove("hello_key") == -704
    assert store.remove_by_regex("(") == -600
    assert store.remove_by_regex("^zc/") == 1  # zc/0..2 were read (leased); zc/3 was not
    assert store.remove_by_regex("^zc/", True) == 3
    assert store.is_exist("zc/0") == 0
    assert store.remove_all() == 1  # important_data; key1..3 leased by get_batch
    assert store.remove_all(True) == 3
    assert store.batch_is_exist(keys + ["important_data"]) == [0, 0, 0, 0]
    assert store.close() == 0


def mooncake_pool_script(store, pool_type) -> None:
    """Mooncake's BufferPool on a set-up ``store`` (issue #33): leases of registered memory for zero-copy put_from
    and get_into. Expected values: real Mooncake 0.3.13's (the crosscheck runs this there too)."""
    import ctypes

    pool = pool_type(store, max_bytes=1 << 20)
    first = pool.acquire(1000)
    assert first.size == 1000 and first.ptr != 0 and len(first.buffer) == 1000
    ctypes.memmove(first.ptr, b"pool" * 250, 1000)
    assert store.put_from("pool/1", first.ptr, 1000) == 0  # registered: zero-copy
    second = pool.buffer(1000)
    assert second.ptr != first.ptr
    assert store.get_into("pool/1", second.ptr, 1000) == 1000 and bytes(second.buffer) == b"pool" * 250
    old = first.ptr
    first.release()
    first.release()  # idempotent
    assert first.size == 1000
    with pytest.raises(RuntimeError, match="buffer lease is closed"):
        first.ptr
    assert pool.acquire(500).ptr == old  # freed space is reused
    with pytest.raises(TypeError):
        pool.acquire(-1)
    with pool.acquire(64) as lease:
        assert lease.size == 64
    with pytest.raises(RuntimeError, match="cannot close buffer pool with active leases"):
        pool.close()
    second.release()
    pool.prewarm(65536, 2)
    pool.close()
    assert store.remove("pool/1", True) == 0  # the store as it was
    with pytest.raises(RuntimeError, match="not initialized"):
        pool_type(None)


def mooncake_more_script(store, master: str, fresh) -> None:
    """More Mooncake-style code (issue #19): the dict setup with size strings, upsert, parts, batch remove,
    BufferHandle reads, soft-pin refusals, tensors. Expected values: real Mooncake 0.3.13's answers (the
    crosscheck runs this script there too). ``fresh()`` makes another store object."""
    import torch

    assert (
        store.setup(
            {
                "local_hostname": "localhost",
                "metadata_server": "http://localhost:8080/metadata",
                "global_segment_size": 0,
                "local_buffer_size": "16 MB",
                "protocol": "tcp",
                "master_server_addr": master,
            }
        )
        == 0
    )
    assert store.health_check() == 0 and isinstance(store.get_hostname(), str)
    assert store.put("u", b"one") == 0
    assert store.upsert("u", b"two!") == 0
    assert store.get("u") == b"two!"
    assert store.upsert_batch(["u", "u2"], [b"3", b"four"]) == 0
    assert store.get_batch(["u", "u2"]) == [b"3", b"four"]
    assert store.put_parts("p", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert store.get("p") == b"abcdef"
    handle = store.get_buffer("u2")
    assert handle.size() == 4 and handle.ptr() != 0
    assert bytes(handle) == b"four" and memoryview(handle).nbytes == 4 and len(handle) == 4
    assert store.get_buffer("absent") is None
    assert store.batch_remove(["p", "absent"], True) == [0, -704]
    buf = np.zeros(1 << 16, dtype=np.uint8)
    buf[:300] = np.arange(300) % 251
    base = buf.ctypes.data
    assert store.register_buffer(base, buf.nbytes) == 0
    assert store.batch_put_from_multi_buffers(["mb/0"], [[base, base + 100]], [[100, 200]]) == [0]
    assert store.upsert_from("uf/0", base + 10, 20) == 0 and store.upsert_from("uf/0", base + 30, 20) == 0
    assert store.batch_upsert_from(["uf/1"], [base], [8]) == [0]
    assert store.get_batch(["uf/0", "uf/1"]) == [bytes(buf[30:50]), bytes(buf[:8])]
    assert store.batch_get_into_multi_buffers(
        ["mb/0", "absent"], [[base + 1000, base + 2000], [base]], [[64, 236], [64]]
    ) == [300, -704]  # any split of the size
    assert np.array_equal(np.concatenate([buf[1000:1064], buf[2000:2236]]), buf[:300])
    assert store.batch_get_into_multi_buffers(["mb/0"], [[base + 1000]], [[299]]) == [-600]  # too small
    assert store.batch_get_into_multi_buffers(["mb/0"], [[base + 1000]], [[4096]]) == [-800]  # larger: Mooncake
    # answers TRANSFER_FAIL (its sizes must add up to the object's; get_into's size is a capacity)
    assert store.batch_put_session_start(["ps/0", "ps/1", "mb/0"], [300, 64, 300]) == [0, 0, -705]  # mb/0 stored
    assert store.batch_is_exist(["ps/0"]) == [0]  # reserved, not readable yet
    assert store.batch_put_from_multi_buffer_ranges(
        ["ps/0", "ps/1"], [[base, base + 100], [base]], [[100, 200], [64]], [[0, 100], [0]]
    ) == [300, 64]
    assert store.batch_put_from_multi_buffer_ranges(["ps/0"], [[base]], [[100]], [[250]]) == [-600]  # past the end
    assert store.batch_put_session_end(["ps/0", "ps/1", "absent"]) == [0, 0, -600]
    assert (store.get("ps/0"), store.get("ps/1")) == (bytes(buf[:300]), bytes(buf[:64]))
    assert store.batch_put_session_start(["ps/2"], [64]) == [0]
    assert store.batch_put_session_revoke(["ps/2", "absent"]) == [0, -600] and store.is_exist("ps/2") == 0
    assert store.batch_get_session_start(["ps/0", "absent"]) == [0, -704]
    assert store.batch_get_into_multi_buffer_ranges(["ps/0"], [[base + 5000, base + 6000]], [[10, 20]], [[5, 200]]) == [
        30
    ]
    assert bytes(buf[5000:5010]) == bytes(buf[5:15]) and bytes(buf[6000:6020]) == bytes(buf[200:220])
    assert store.batch_get_into_multi_buffer_ranges(["ps/1"], [[base + 5000]], [[10]], [[0]]) == [-600]  # no session
    assert store.batch_get_session_end(["ps/0"]) == 0
    buf[7000:7010] = 7
    assert store.put_from_with_metadata("pm/0", base + 100, base + 7000, 50, 10) == 0
    assert store.get("pm/0") == bytes(buf[7000:7010]) + bytes(buf[100:150])  # metadata first
    [replica] = store.get_replica_desc("ps/0")
    assert replica.is_memory_replica() and not replica.is_disk_replica() and replica.status.name == "COMPLETE"
    assert replica.get_memory_descriptor().buffer_descriptor.size == 300
    assert store.get_replica_desc("absent") == [] and list(store.batch_get_replica_desc(["ps/0", "absent"])) == ["ps/0"]
    assert store.get_into_ranges(
        [base + 8000, base + 9000],
        [["ps/0", "ps/1"], ["ps/0"]],
        [[[0, 10], [20]], [[0]]],
        [[[0, 5], [1]], [[100]]],
        [[[4, 4], [8]], [[16]]],
    ) == [[[4, 4], [8]], [[16]]]
    assert (bytes(buf[8000:8004]), bytes(buf[8010:8014]), bytes(buf[8020:8028]), bytes(buf[9000:9016])) == (
        bytes(buf[0:4]),
        bytes(buf[5:9]),
        bytes(buf[1:9]),
        bytes(buf[100:116]),
    )
    assert store.get_into_ranges([base + 8000], [["absent"]], [[[0]]], [[[0]]], [[[4]]]) == [[[-704]]]
    assert store.batch_replica_clear(["ps/1", "absent"]) == [] and store.is_exist("ps/1") == 1  # leased: kept
    assert store.unregister_buffer(base) == 0
    soft = ReplicateConfig()
    soft.soft_pin_ttl_ms = 1000  # a TTL without soft_pin_action ENABLE: refused
    assert store.put("soft", b"x", soft) == -600
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert store.put_tensor("t/0", t) == 0
    back = store.get_tensor("t/0")
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    assert store.get_tensor("t/absent") is None
    assert store.batch_put_tensor(["t/1", "t/2"], [t.to(torch.bfloat16), t.to(torch.int8)]) == [0, 0]
    got = store.batch_get_tensor(["t/1", "t/2", "t/absent"])
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], t.to(torch.bfloat16))
    assert got[1].dtype == torch.int8 and torch.equal(got[1], t.to(torch.int8)) and got[2] is None
    rows = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)
    assert store.put_tensor_with_tp("tp/w", rows, 0, 2, 0) == 0  # shards "tp/w_tp_0", "tp/w_tp_1"
    assert torch.equal(store.get_tensor("tp/w_tp_0"), rows[:2])
    assert torch.equal(store.get_tensor("tp/w_tp_1"), rows[2:])
    assert store.get_tensor("tp/w") is None
    assert torch.equal(store.get_tensor_with_tp("tp/w", 1, 2), rows[2:])
    assert [torch.equal(a, b) for a, b in zip(store.batch_get_tensor_with_tp(["tp/w"], 0, 2), [rows[:2]])] == [True]
    assert store.put_tensor_with_tp("tp/c", rows, 0, 3, 1) == 0  # by columns
    assert torch.equal(store.get_tensor_with_tp("tp/c", 2, 3), rows[:, 2:])
    assert store.put_tensor_with_tp("tp/u", rows, 0, 3, 0) == -600  # 4 rows do not split over 3
    assert store.get_tensor_with_tp("tp/absent", 0, 2) is None
    assert store.pub_tensor("t/p", t, ReplicateConfig()) == 0 and torch.equal(store.get_tensor("t/p"), t)
    assert store.upsert_tensor("t/p", t * 2) == 0 and torch.equal(store.get_tensor("t/p"), t * 2)
    assert store.batch_upsert_tensor(["t/p", "t/q"], [t * 3, t]) == [0, 0]
    assert torch.equal(store.batch_get_tensor(["t/p"])[0], t * 3)
    assert store.upsert_pub_tensor("t/q", t * 4, ReplicateConfig()) == 0 and torch.equal(store.get_tensor("t/q"), t * 4)
    assert store.batch_upsert_pub_tensor(["t/q"], [t * 5], ReplicateConfig()) == [0]
    assert store.batch_pub_tensor(["t/r"], [t], ReplicateConfig()) == [0]
    assert store.batch_put_tensor_with_tp(["tp/b"], [rows], 0, 2, 0) == [0]
    assert store.pub_tensor_with_tp("tp/p", rows, ReplicateConfig(), 0, 2, 0) == 0
    assert store.batch_pub_tensor_with_tp(["tp/q"], [rows], ReplicateConfig(), 0, 2, 0) == [0]
    assert torch.equal(store.get_tensor_with_tp("tp/q", 0, 2), rows[:2])
    assert store.upsert_parts("p2", b"xy", b"z") == 0 and store.upsert_parts("p2", b"w") == 0
    assert store.get("p2") == b"w"
    assert [h.size() for h in store.batch_get_buffer(["p2", "u2"])] == [1, 4]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/w.safetensors"
        assert store.save_tensor_to_safetensor("t/p", path) == 0
        loaded = store.load_tensor_from_safetensor(key="t/loaded", file_name=path)
        assert torch.equal(loaded, t * 3) and torch.equal(store.get_tensor("t/loaded"), t * 3)
    tb = np.zeros(8192, dtype=np.uint8)  # tensors in a caller's buffer, in Mooncake's layout
    tb_base = tb.ctypes.data
    assert store.register_buffer(tb_base, tb.nbytes) == 0
    got = store.get_tensor_into("t/0", tb_base, 4096)
    assert torch.equal(got, t) and got.data_ptr() == tb_base + 304  # a view of the caller's buffer
    assert bytes(tb[:40]).hex() == (
        "4e4f4f4d0100300100000000020000000000000000000000"  # Mooncake's own bytes
        "30010000000000003000000000000000"
    )
    assert store.get_tensor_into("t/0", tb_base, 300) is None  # too small
    assert store.put_tensor_from("t/from", tb_base, 304 + 48) == 0
    assert torch.equal(store.get_tensor("t/from"), t)
    assert store.upsert_tensor_from("t/from", tb_base, 304 + 48) == 0
    assert store.batch_put_tensor_from(["t/f2", "t/bad"], [tb_base, tb_base + 1], [352, 352]) == [-600, -600]
    assert store.put_tensor_from("t/bad", tb_base, 100) == -600  # one bad buffer fails the batch
    assert store.batch_put_tensor_from(["t/f2"], [tb_base], [352]) == [0]
    assert store.batch_upsert_tensor_from(["t/f2"], [tb_base], [352]) == [0]
    got = store.batch_get_tensor_into(["t/f2", "t/absent"], [tb_base + 4096, tb_base + 6000], [2000, 2000])
    assert torch.equal(got[0], t) and [g is None for g in got] == [False, True]
    assert store.put_tensor_with_tp_from("tp/from", tb_base, 352, 0, 2, 1) == 0  # 4 columns over 2
    assert torch.equal(store.get_tensor_with_tp_into("tp/from", tb_base + 4096, 2000, 1, 2, 1), t[:, 2:])
    assert store.put_tensor_with_tp_from("tp/odd", tb_base, 352, 0, 2, 0) == -600  # 3 rows over 2
    assert store.batch_put_tensor_with_tp_from(["tp/from2"], [tb_base], [352], 0, 3, 0) == [0]  # 3 rows over 3
    [shard] = store.batch_get_tensor_with_tp_into(["tp/from2"], [tb_base + 4096], [2000], 2, 3)
    assert torch.equal(shard, t[2:])
    assert store.unregister_buffer(tb_base) == 0
    assert store.remove_all(True) >= 20
    assert store.close() == 0
    other = fresh()  # no local buffer: setup works, the bytes API refuses
    assert other.setup("localhost", "http://localhost:8080/metadata", 0, 0, "tcp", "", master) == 0
    assert (other.put("lb0", b"x"), other.get("lb0"), other.put_batch(["lb0"], [b"x"])) == (-600, b"", -600)
    assert other.close() == 0


def test_buffer_pool_leases_registered_memory():
    with store_cluster(nodes=1, segment_size="16MiB") as c:
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "", 0, 1 << 20, "tcp", "", c.master) == 0
        mooncake_pool_script(store, compat.BufferPool)
        assert compat.RegisteredBufferPool is compat.BufferPool
        assert store.close() == 0


def test_more_mooncake_code_runs_on_our_store():
    with store_cluster(nodes=2, segment_size="4MiB", master_flags={"lease_ttl_ms": 60000}) as c:
        mooncake_more_script(MooncakeDistributedStore(), c.master, MooncakeDistributedStore)


def test_mooncake_script_runs_on_our_store():
    with store_cluster(nodes=2, segment_size="4MiB", master_flags={"lease_ttl_ms": 60000}) as c:
        ctl = control_client(c.master, 3000)
        mooncake_style_script(MooncakeDistributedStore(), c.master)
        assert ctl.call("status")["objects"] == 0
        ctl.close()


def mooncake_replica_clear_script(store, master: str, config_cls, lease_s: float) -> None:
    """batch_replica_clear as Mooncake 0.3.13 answers it (tests/mooncake/mooncake_crosscheck.py runs this on the
    real wheel and master, whose read lease is 10 s): with segment_name only the replica there goes and the object
    stays readable from the other; a leased object is skipped; choosing takes no lease. Needs two segments."""
    assert store.setup("localhost", "", 0, 1 << 20, "tcp", "", master) == 0
    cfg = config_cls()
    cfg.replica_num = 2
    assert store.put("rc/1", b"a" * 1000, cfg) == 0 and store.put("rc/2", b"b" * 1000, cfg) == 0
    first, second = (
        r.get_memory_descriptor().buffer_descriptor.transport_endpoint for r in store.get_replica_desc("rc/1")
    )  # a read lease, as a get takes
    assert store.batch_replica_clear(["rc/1"], first) == []  # leased: kept
    time.sleep(lease_s)
    assert store.batch_replica_clear(["rc/1", "rc/2", "absent"], first) == ["rc/1", "rc/2"]
    assert store.batch_replica_clear(["rc/1"], first) == []  # none left there
    assert store.get("rc/1") == b"a" * 1000 and store.get("rc/2") == b"b" * 1000
    assert [r.get_memory_descriptor().buffer_descriptor.transport_endpoint for r in store.get_replica_desc("rc/1")] == [
        second
    ]
    time.sleep(lease_s)
    assert store.batch_replica_clear(["rc/1"], second) == ["rc/1"] and store.is_exist("rc/1") == 0
    assert store.batch_replica_clear(["rc/2"]) == ["rc/2"] and store.is_exist("rc/2") == 0  # every replica
    assert store.close() == 0


def test_batch_replica_clear_with_a_segment_drops_only_that_replica():
    with store_cluster(nodes=2, segment_size="4MiB", master_flags={"lease_ttl_ms": 1500}) as c:
        mooncake_replica_clear_script(MooncakeDistributedStore(), c.master, ReplicateConfig, 1.6)


def test_replica_num_places_two_replicas_and_pins_map():
    with store_cluster(nodes=2, segment_size="4MiB") as c:
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "", 0, 1 << 20, "tcp", "", c.master) == 0
        cfg = ReplicateConfig()
        cfg.replica_num, cfg.with_hard_pin = 2, True
        assert store.put("r2", b"r" * 1000, cfg) == 0
        ctl = control_client(c.master, 3000)
        assert sorted(s["objects"] for s in ctl.call("status")["segments"]) == [1, 1]  # one per node
        ctl.close()
        put = cfg.to_put_config(compat_defaults())
        assert (put.replicas, put.pin) == (2, "hard")
        cfg.with_hard_pin, cfg.soft_pin_action, cfg.soft_pin_ttl_ms = False, compat.SoftPinAction.ENABLE, 500
        assert cfg.to_put_config(compat_defaults()).pin == "soft"
        cfg.replica_num = 0
        assert store.put("bad", b"x", cfg) == -600  # INVALID_PARAMS, not an exception
        assert store.close() == 0


def test_preferred_segment_get_hostname_keeps_the_object_on_the_callers_segment():
    """Mooncake 0.3.13: get_hostname() is the caller's segment name, and preferred_segment=get_hostname() puts
    the object there, though another node's segment is emptier."""
    with store_cluster(nodes=1, segment_size="64MiB") as c:
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "", 8 << 20, 1 << 20, "tcp", "", c.master) == 0
        own = store.get_hostname()
        ctl = control_client(c.master, 3000)
        names = [s["name"] for s in ctl.call("status")["segments"]]
        ctl.close()
        assert own in names and len(names) == 2
        cfg = ReplicateConfig()
        cfg.preferred_segment = own
        for i in range(4):
            assert store.put(f"own/{i}", bytes([i]) * 1000, cfg) == 0
            (replica,) = store.get_replica_desc(f"own/{i}")
            assert replica.get_memory_descriptor().buffer_descriptor.transport_endpoint == own
        assert store.close() == 0


def compat_defaults():
    from kvplugins.store.placement import PutConfig

    return PutConfig()


def test_errors_are_codes_before_setup_and_when_master_is_down(monkeypatch):
    store = MooncakeDistributedStore()
    assert store.put("k", b"v") == -1 and store.get("k") == b"" and store.is_exist("k") == -1
    assert store.batch_get_into(["a", "b"], [0, 0], [1, 1]) == [-1, -1]
    assert store.get_batch(["a"]) == [b""]
    monkeypatch.setenv("KVPLUGINS_CLIENT_RPC_TIMEOUT_MS", "300")
    with store_cluster(nodes=0) as c:
        master = c.master
    assert store.setup("localhost", "", 0, 1 << 20, "tcp", "", master) == -900  # RPC_FAIL
    assert store.setup({"local_hostname": "localhost", "bogus": 1}) == -600
    assert store.setup("localhost", "", 0, 1 << 20, "ib", "", master) == -600


def test_remove_checked_of_one_segment_frees_that_replica_after_its_lease():
    from kvplugins.store.config import MasterConfig
    from kvplugins.store.master.service import MasterService
    from kvplugins.store.wire.protocol import OK

    now = [100.0]
    m = MasterService(MasterConfig(lease_ttl_ms=1000), clock=lambda: now[0])
    segs = []
    for i in range(2):
        wire = {"v": 1, "segment_id": f"s{i}", "host_id": f"h{i}", "transports": {}, "regions": [[1, 4096, None]]}
        [(code, name)] = m.handle("register_segment", [[wire, 1, 4096]], {})
        segs.append(name)
    assert m.handle("put_start", [["k", 100]], {"replicas": 2})[0][0] == OK
    assert m.handle("put_commit", ["k"], {})[0][0] == OK
    [(code, [size, replicas, ttl, _])] = m.handle("get", ["k"], {})  # a reader's lease
    assert sorted(r[0] for r in replicas) == sorted(segs)
    assert m.handle("remove_checked", ["k"], {"segment": segs[0]}) == ["leased"]
    now[0] += 1.5
    assert m.handle("remove_checked", ["k", "zz"], {"segment": segs[0]}) == ["cleared", "missing"]
    assert [r[0] for r in m.handle("get", ["k"], {})[0][1][1]] == [segs[1]]
    m.tick()
    assert m.segments.get(segs[0]).used == 0  # no lease on the dropped bytes
    now[0] += 1.5
    assert m.handle("remove_checked", ["k"], {"segment": segs[0]}) == ["elsewhere"]
    assert m.handle("remove_checked", ["k"], {"segment": segs[1]}) == ["removed"] and len(m.table) == 0


def test_admin_ops_honour_leases():
    from kvplugins.store.config import MasterConfig
    from kvplugins.store.master.service import MasterService
    from kvplugins.store.wire.protocol import INVALID, NOT_FOUND, OK

    now = [100.0]
    m = MasterService(MasterConfig(lease_ttl_ms=1000), clock=lambda: now[0])
    wire = {"v": 1, "segment_id": "s", "host_id": "h", "transports": {}, "regions": [[1, 4096, None]]}
    [(code, seg)] = m.handle("register_segment", [[wire, 1, 4096]], {})
    assert code == OK
    for key in ("a/1", "a/2", "b/1"):
        assert m.handle("put_start", [[key, 100]], {})[0][0] == OK
        assert m.handle("put_commit", [key], {})[0][0] == OK
    assert m.handle("put_start", [["p/1", 100]], {})[0][0] == OK  # pending: not counted, not removed
    assert m.handle("get_size", ["a/1", "p/1", "zz"], {}) == [[OK, 100], [NOT_FOUND, None], [NOT_FOUND, None]]
    with pytest.raises(ValueError, match=r"get_size: entries: Expected `str`, got `int` - at `\$\[1\]`"):
        m.handle("get_size", ["a/1", 7], {})  # a non-string key refuses the op
    m.handle("get", ["a/1"], {})  # lease on a/1
    used = m.segments.get(seg).used
    assert m.handle("remove_by_regex", ["^a/"], {}) == [OK, 1]  # leased a/1 skipped
    assert m.handle("remove_checked", ["a/1", "a/2"], {}) == ["leased", "missing"]
    assert m.handle("remove_by_regex", ["^a/"], {"force": True}) == [OK, 1]
    assert m.handle("remove_by_regex", ["("], {})[0] == INVALID
    assert m.segments.get(seg).used == used - 128  # a/2 freed; leased a/1 still held
    now[0] += 1.5
    m.tick()
    assert m.segments.get(seg).used == used - 256  # lease over: freed
    m.handle("get", ["b/1"], {})
    assert m.handle("remove_all", [], {}) == [OK, 0]  # b/1 leased
    assert m.handle("remove_checked", ["b/1"], {"force": True}) == ["removed"]
    assert m.handle("remove_all", [], {"force": True}) == [OK, 0] and len(m.table) == 1  # the pending put stays
    for key, pin in (("h/1", 2), ("s/1", 1)):  # hard and soft pinned objects too
        assert m.handle("put_start", [[key, 100]], {"pin": pin, "pin_ttl_ms": 60000})[0][0] == OK
        assert m.handle("put_commit", [key], {})[0][0] == OK
    assert m.handle("remove_by_regex", ["^h/"], {}) == [OK, 1]
    assert m.handle("remove_all", [], {}) == [OK, 1] and len(m.table) == 1


def test_same_script_gives_the_same_codes_on_real_mooncake():
    """The expectations above are Mooncake's: the script passes against a real mooncake_master too (in a private
    network namespace, since Mooncake binds 0.0.0.0; needs root for `unshare -n`)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("mooncake.store")
    if not (Path(sys.executable).parent / "mooncake_master").exists():
        pytest.skip("mooncake_master not installed next to this interpreter (benchmarks/install_mooncake.sh)")
    if os.geteuid() != 0 or subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare -n` (root) for a private network namespace")
    import signal

    proc = subprocess.Popen(
        ["unshare", "-n", sys.executable, str(Path(__file__).with_name("mooncake_crosscheck.py"))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # Mooncake's processes too (same session)
            proc.wait(10)
    assert proc.returncode == 0 and "SCRIPT OK" in out, (out[-2000:], err[-3000:])


# One valid value and the refused ones per annotation: a call with one refused argument (the others valid) must
# raise TypeError on Mooncake's binding (before any C++ runs, so no setup is needed) and on ours (issue #19).
GOOD = {
    "str": "k",
    "int": 64,
    "tuple[int, int]": (1, 2),
    "I32": 1,
    "bool": False,
    "list[str]": ["k"],
    "list[int]": [64],
    "list[list[int]]": [[64]],
    "list[list[str]]": [["k"]],
    "list[list[list[int]]]": [[[64]]],
    "Buffer": b"v",
    "list[Buffer]": [b"v"],
    "ReplicateConfig": None,
    "object": None,
    "list": [],
}
BAD = {
    "tuple[int, int]": [(1,), (1, 2, 3), ("a", 2), (-1, 2), (1.5, 2), None, "x", (1 << 64, 1)],
    "str": [1, None, 1.5],
    "int": ["1", 1.5, -1, None],
    "I32": ["1", 1.5, None, 1 << 40],
    "bool": ["yes", [1]],
    "list[str]": ["ab", [1], None],
    "list[int]": ["ab", [1.5], [-1]],
    "list[list[int]]": [[1], ["ab"], [[-1]]],
    "Buffer": ["str", 1, None],
    "list[Buffer]": [["str"], "ab"],
    "list[list[str]]": [["k"], [[1]]],
    "list[list[list[int]]]": [[[1]], [[[-1]]]],
    "ReplicateConfig": [None, 1],
}
PROBED = [m for m in METHODS if m not in ("setup", "close", "get_hostname", "health_check")]


def bad_calls(cls, config_cls):
    """(method, description, args, kwargs) of calls with one argument of a refused type, from our signatures."""
    import inspect

    out = []
    for name in PROBED:
        params = [
            p
            for p in inspect.signature(getattr(cls, name)).parameters.values()
            if p.name != "self" and p.kind != p.VAR_POSITIONAL and p.annotation in GOOD
        ]
        good = {p.name: (config_cls() if p.annotation == "ReplicateConfig" else GOOD[p.annotation]) for p in params}
        for p in params:
            for bad in BAD.get(p.annotation, []):
                args = {**good, p.name: bad}
                pos = [args[q.name] for q in params if q.kind == q.POSITIONAL_ONLY]
                kw = {q.name: args[q.name] for q in params if q.kind != q.POSITIONAL_ONLY}
                out.append((name, f"{name}({p.name}={bad!r})", pos, kw))
    return out


PROBE_SCRIPT = """
import sys, json
sys.path[:0] = {paths!r}
import test_mooncake_api
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
store = MooncakeDistributedStore()
for name, what, pos, kw in test_mooncake_api.bad_calls(test_mooncake_api.MooncakeDistributedStore, ReplicateConfig):
    try:
        getattr(store, name)(*pos, **kw)
        print(json.dumps([what, "accepted"]), flush=True)
    except TypeError:
        print(json.dumps([what, "TypeError"]), flush=True)
"""


def test_bad_arguments_raise_type_error_as_on_mooncake():
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("mooncake.store")
    calls = bad_calls(MooncakeDistributedStore, ReplicateConfig)
    assert len(calls) > 150
    store = MooncakeDistributedStore()
    for name, what, pos, kw in calls:
        with pytest.raises(TypeError):
            getattr(store, name)(*pos, **kw)
        assert store.close() == 0
    here = Path(__file__).resolve().parent
    out = subprocess.run(
        [sys.executable, "-c", PROBE_SCRIPT.format(paths=[str(here), str(here.parent)])],
        capture_output=True,
        text=True,
        timeout=120,
    )  # their side, in a child: a call
    theirs = dict(json.loads(line) for line in out.stdout.splitlines())  # it accepts would run unset C++
    assert out.returncode == 0 and len(theirs) == len(calls), out.stderr[-2000:]
    assert {what: r for what, r in theirs.items() if r != "TypeError"} == {}


@pytest.fixture(scope="module")
def compat_store():
    with store_cluster(nodes=1, segment_size="16MiB") as c:
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "", 0, 1 << 20, "tcp", "", c.master) == 0
        yield store, c
        store.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int8", "uint8"])
def test_tensor_round_trip_keeps_dtype_shape_and_bytes(compat_store, dtype, tmp_path):
    import torch

    store, _ = compat_store
    dt = getattr(torch, dtype)
    base = (torch.arange(4 * 6 * 5) % 97).reshape(4, 6, 5).to(dt)
    strided = base.transpose(0, 2)[:, 1:5:2]  # non-contiguous input
    assert not strided.is_contiguous()
    assert store.put_tensor(f"tensor/{dtype}", strided) == 0
    back = store.get_tensor(f"tensor/{dtype}")
    assert back.dtype == dt and back.shape == strided.shape and torch.equal(back, strided)
    assert store.upsert_tensor(f"tensor/{dtype}", base) == 0
    assert torch.equal(store.get_tensor(f"tensor/{dtype}"), base)
    path = tmp_path / f"{dtype}.safetensors"
    assert store.save_tensor_to_safetensor(f"tensor/{dtype}", str(path)) == 0
    loaded = store.load_tensor_from_safetensor(f"tensor/{dtype}", str(path))
    assert torch.equal(loaded, base)
    assert store.put_tensor("tensor/bad", [1, 2]) == -600  # not a tensor: INVALID_PARAMS
    assert store.save_tensor_to_safetensor("tensor/absent", str(path)) == -704


def test_setup_reads_size_strings_as_mooncake():
    from kvplugins.errors import ConfigError
    from kvplugins.mooncake.checks import byte_size

    assert [byte_size("s", t) for t in ("16MB", "16 MB", "16mb", "4096", "2 GB", "1kb", "3 B")] == [
        16 << 20,
        16 << 20,
        16 << 20,
        4096,
        2 << 30,
        1024,
        3,
    ]
    for text in ("16 MiB", "1.5GB", "", "MB"):
        with pytest.raises(ConfigError):
            byte_size("s", text)


EXIT_SCRIPT = """
import sys
from kvplugins.mooncake import MooncakeDistributedStore
store = MooncakeDistributedStore()
assert store.setup("localhost", "", 4 << 20, 1 << 20, "tcp", "", sys.argv[1]) == 0
assert store.put("exit/k", b"v" * 1000) == 0
print("READY", flush=True)
"""


GC_SCRIPT = """
import gc, sys
from kvplugins.mooncake import MooncakeDistributedStore
store = MooncakeDistributedStore()
assert store.setup("localhost", "", 4 << 20, 1 << 20, "tcp", "", sys.argv[1]) == 0
print("MOUNTED", flush=True)
sys.stdin.readline()
del store
gc.collect()
print("DROPPED", flush=True)
sys.stdin.readline()
"""


def test_store_collected_without_close_unregisters_its_segment_then():
    """Mooncake 0.3.13: a store garbage-collected without close() unmounts its segment then (its destructor),
    while the program goes on, not only at exit."""
    import subprocess
    import sys

    with store_cluster(nodes=1, segment_size="4MiB", master_flags={"heartbeat_timeout_ms": 60000}) as c:
        ctl = control_client(c.master, 3000)
        child = subprocess.Popen(
            [sys.executable, "-c", GC_SCRIPT, c.master], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout.readline().strip() == "MOUNTED"
            assert len(ctl.call("status")["segments"]) == 2
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "DROPPED"
            assert len(ctl.call("status")["segments"]) == 1  # gone while the program still runs
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.wait(timeout=60) == 0
        finally:
            child.kill()
            ctl.close()


def test_exit_without_close_unregisters_the_segment():
    """A Mooncake-style program that exits without close(): its segment leaves the master at exit, so the next
    client's puts never land on a dead segment (issue #19)."""
    import subprocess
    import sys

    with store_cluster(nodes=1, segment_size="4MiB", master_flags={"heartbeat_timeout_ms": 60000}) as c:
        ctl = control_client(c.master, 3000)
        assert len(ctl.call("status")["segments"]) == 1
        out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, c.master], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "READY" in out.stdout, out.stderr[-2000:]
        assert len(ctl.call("status")["segments"]) == 1  # gone at once, not after the 60 s timeout
        ctl.close()
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "", 0, 1 << 20, "tcp", "", c.master) == 0
        assert [store.put(f"after/{i}", b"w" * 1000) for i in range(20)] == [0] * 20
        assert store.close() == 0
