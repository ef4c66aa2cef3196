"""The RDMA transport where this host has no RDMA device (every CI host): the probe says why it is absent and
routing is unchanged; the pure parts (NIC pairing, striping weights, path health) on their own. The transport
itself is tested on real verbs in the soft-RoCE guest (tests/rdma/guest)."""

import logging

import pytest

from kvplugins.errors import ConfigError
from kvplugins.transfer import TransferConfig, TransferEngine
from kvplugins.transfer.rdma_paths import Path, PathStats, pair, stripe


def test_absent_rdma_is_one_log_line_and_routing_is_unchanged(caplog):
    with caplog.at_level(logging.DEBUG, logger="kvplugins.transfer"):  # INFO the first time in a process
        with TransferEngine(TransferConfig(transports="shm,rdma,tcp")) as eng:
            desc = eng.descriptor()
            stats = eng.stats()
    lines = [r.getMessage() for r in caplog.records if "rdma transport absent" in r.getMessage()]
    assert len(lines) == 1 and ("pyverbs" in lines[0] or "/sys/class/infiniband" in lines[0]), lines
    assert list(desc.transports) == ["shm", "tcp"] and "rdma" not in stats
    assert all(r.rdma is None for r in desc.regions)


def test_default_transports_offer_rdma_first_after_the_same_host_ones():
    assert TransferConfig().transport_list() == ["shm", "cma", "rdma", "tcp"]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"transports": "rdma"}, "add tcp"),
        ({"transports": "shm,rdma"}, "add tcp"),
        ({"rdma_signal_every": 100, "rdma_queue_depth": 128}, "at most half of rdma_queue_depth"),
        ({"rdma_max_wr": 100}, "rdma_max_wr=100"),
        ({"rdma_max_wr": 2 << 30}, "at most 1 GiB"),
        ({"rdma_qps_per_peer": 0}, "rdma_qps_per_peer=0"),
        ({"rdma_probe_ms": 0}, "rdma_probe_ms=0"),
    ],
)
def test_rdma_config_errors_name_the_value_and_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match):
        TransferConfig(**kw)


def test_transfer_env_reaches_every_component(monkeypatch):
    """KVPLUGINS_TRANSFER_* settings reach the engines that nodes, clients and adapters build (transfer_config),
    under their own host/transports."""
    from kvplugins.transfer.config import transfer_config

    monkeypatch.setenv("KVPLUGINS_TRANSFER_RDMA_DEVICES", "mlx5_0,mlx5_1")
    monkeypatch.setenv("KVPLUGINS_TRANSFER_TRANSPORTS", "tcp")
    cfg = transfer_config(host="127.0.0.1", transports="shm,rdma,tcp")
    assert cfg.rdma_devices == "mlx5_0,mlx5_1" and cfg.transports == "shm,rdma,tcp"


def test_nics_pair_by_subnet_else_by_index():
    local = ["10.0.0.5/24", "10.0.1.5/24"]
    assert pair(local, ["10.0.1.9/24", "10.0.0.9/24"]) == [Path(0, 1), Path(1, 0)]
    assert pair(local, ["192.168.0.9/24"]) == []  # no common subnet: RoCE cannot route it
    assert pair([None, None], [None]) == [Path(0, 0), Path(1, 0)]  # InfiniBand: by index
    assert pair([None, None, None], [None, None]) == [Path(0, 0), Path(1, 1), Path(2, 0)]


def test_stripe_shares_bytes_by_weight():
    owner = stripe([1 << 20] * 30, [2.0, 1.0])
    assert owner.count(0) == 20 and owner.count(1) == 10
    assert stripe([4096], [0.0, 5.0]) == [1]  # the only weighted path


def test_path_stats_measure_fail_and_recover():
    stats = PathStats(probe_s=0.05)
    key = ("seg", 0, 0)
    assert stats.weight(key, 7.0) == 7.0  # seeded from the link speed
    stats.sample(key, "rxe0->0", 1 << 20, 0.01)
    assert stats.weight(key, 7.0) == pytest.approx((1 << 20) / 0.01)
    stats.sample(key, "rxe0->0", 1000, 0.01)  # too small to be a throughput sample
    assert stats.weight(key, 7.0) == pytest.approx((1 << 20) / 0.01)
    assert stats.snapshot()["path_bytes"] == {"rxe0->0": (1 << 20) + 1000}
    stats.failed(key)
    assert not stats.up(key) and stats.snapshot()["path_failures"] == 1
    import time

    time.sleep(0.06)
    assert stats.up(key)  # probed back after probe_s
