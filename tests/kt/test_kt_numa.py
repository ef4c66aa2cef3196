"""NUMA subpools on a faked two-node topology.

This machine has one NUMA node and no libnuma, so the node map is faked: a temporary directory laid out like
/sys/devices/system/node (node<N>/cpulist) is passed as ``node_root``. What this proves: each subpool's threads are
pinned to the CPUs of its node, a missing node is reported and nothing is pinned, the wrapper picks one node per
subpool from the topology, and results are bit-identical to one unpinned subpool. What it cannot prove here: that
first-touch places each weight shard's pages on its subpool's node (that needs two real nodes).
"""

import os

import pytest
import torch

from kt_ref import random_experts, routing
from kvplugins.kt_expert_backend import KTMoEWrapper, native

CPUS = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to fake two nodes")


def _fake_nodes(root, cpu_lists):
    for n, cpus in enumerate(cpu_lists):
        (root / f"node{n}").mkdir()
        (root / f"node{n}" / "cpulist").write_text(cpus + "\n")
    return str(root)


def _thread_affinity() -> dict:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            status = open(f"/proc/self/task/{tid}/status").read()
        except OSError:  # the thread exited
            continue
        out[tid] = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
    return out


def _forward(pool):
    E, H, I, K, T = 4, 256, 256, 2, 9
    w = random_experts(E, H, I, seed=21)
    layer = native.Layer("int8", E, H, I)
    for e in range(E):
        for name, m in zip(("gate", "up", "down"), w):
            layer.set_float(pool, e, name, m[e])  # shard s first touched by subpool s
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ids, wt = routing(T, E, K)
    out = torch.empty(T, H)
    layer.forward(pool, x, ids, wt, None, out)
    return out


def test_each_subpool_is_pinned_to_its_nodes_cpus(tmp_path):
    root = _fake_nodes(tmp_path, [str(CPUS[0]), str(CPUS[1])])
    before = set(_thread_affinity())
    pool = native.Pool(2, 2, [0, 1], spin_us=0, node_root=root)
    new = {t: a for t, a in _thread_affinity().items() if t not in before}
    assert "pinned to NUMA nodes" in pool.describe()
    # the job thread leads subpool 0 (node0), the one worker serves subpool 1 (node1)
    assert sorted(new.values()) == sorted([str(CPUS[0]), str(CPUS[1])])
    assert torch.equal(_forward(pool), _forward(native.Pool(1, 1, spin_us=0)))


def test_a_missing_node_pins_nothing_and_says_so(tmp_path):
    root = _fake_nodes(tmp_path, [str(CPUS[0])])
    pool = native.Pool(2, 2, [0, 1], spin_us=0, node_root=root)
    assert "a requested NUMA node does not exist" in pool.describe()


def test_wrapper_maps_subpools_to_nodes_from_the_topology(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPLUGINS_KT_NUMA_SYSFS", _fake_nodes(tmp_path, [str(CPUS[0]), str(CPUS[1])]))
    m = KTMoEWrapper(
        layer_idx=0,
        num_experts=4,
        num_experts_per_tok=2,
        hidden_size=256,
        moe_intermediate_size=256,
        num_gpu_experts=0,
        cpuinfer_threads=2,
        threadpool_count=2,
        method="AMXINT8",
    )
    assert "2 subpool(s), pinned to NUMA nodes" in m.engine.pool.describe()
