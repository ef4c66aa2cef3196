"""The RDMA transport where this host has no RDMA device (every CI host): the probe says why it is absent and
routing is unchanged; the pure parts (NIC pairing, striping weights, path health) on their own. The transport
itself is tested on real verbs in the soft-RoCE guest (tests/rdma/guest)."""

import logging
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvplugins.errors import ConfigError
from kvplugins.transfer import TransferConfig, TransferEngine
from kvplugins.transfer.rdma_paths import Path, PathStats, pair, stripe
from kvplugins.transfer.rdma_wrs import Spans, coalesce


def test_absent_rdma_is_one_log_line_and_routing_is_unchanged(caplog):
    with caplog.at_level(logging.DEBUG, logger="kvplugins.transfer"):  # INFO the first time in a process
        with TransferEngine(TransferConfig(transports="shm,rdma,tcp")) as eng:
            desc = eng.descriptor()
            stats = eng.stats()
    lines = [r.getMessage() for r in caplog.records if "rdma transport absent" in r.getMessage()]
    assert len(lines) == 1 and ("libibverbs" in lines[0] or "/sys/class/infiniband" in lines[0]), lines
    assert list(desc.transports) == ["shm", "tcp"] and "rdma" not in stats
    assert all(r.rdma is None for r in desc.regions)


def _libibverbs() -> str | None:
    """The path the dynamic loader resolves libibverbs.so.1 to, or None."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"libibverbs\.so\.1 \(.*\) => (\S+)", out)
    return os.path.realpath(m.group(1)) if m else None


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare (mount namespace)")
@pytest.mark.skipif(_libibverbs() is None, reason="libibverbs1 is not installed (ci/install.sh installs it)")
def test_a_process_without_libibverbs_imports_and_falls_back_with_one_line():
    """libibverbs is loaded at run time: in a mount namespace where libibverbs.so.1 is /dev/null, a process
    still imports kvplugins, its engine offers shm and tcp, and the one log line names the library and the fix."""
    code = (
        "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from kvplugins.transfer import TransferConfig, TransferEngine, rdma_verbs\n"
        "print('load_error:', rdma_verbs.load_error())\n"
        "with TransferEngine(TransferConfig(transports='rdma,tcp')) as eng:\n"
        "    print('transports:', list(eng.descriptor().transports))\n"
    )
    script = f'mount --bind /dev/null {_libibverbs()} && exec {sys.executable} -c "$0"'
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "load_error: libibverbs.so.1 cannot be loaded (" in r.stdout and "apt-get install libibverbs1" in r.stdout
    assert "transports: ['tcp']" in r.stdout, r.stdout
    lines = [ln for ln in r.stderr.splitlines() if "rdma transport absent" in ln]
    assert len(lines) == 1 and "libibverbs.so.1 cannot be loaded" in lines[0], r.stderr


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


def test_entries_coalesce_into_spans_that_name_the_entries_they_cover():
    """rdma_wrs.coalesce: entries contiguous on both sides with the same keys become one span (the native call cuts
    spans into work requests), and a failed span maps back to exactly the entries it covers."""
    lkeys = [(7, 8), (7, 8), (7, 8), (9, 9)]
    s = coalesce([0, 100, 300, 400], [1000, 1100, 1300, 1400], [100, 200, 100, 50], lkeys, [(5, 6)] * 4)
    # entries 0, 1 and 2 are contiguous on both sides with the same keys; entry 3 has other lkeys
    assert (s.length, s.laddr, s.raddr, s.lkeys, s.rkeys) == (
        [400, 50],
        [0, 400],
        [1000, 1400],
        [[7, 9], [8, 9]],
        [[5, 5], [6, 6]],
    )
    assert s.callers([1]) == [3] and s.callers([0, 1]) == [0, 1, 2, 3]
    assert s.path([1], 1, 0) == ([400], [9], [1400], [5], [50])
    apart = coalesce([0, 100], [0, 200], [100, 100], lkeys[:2], [(5, 6)] * 2)
    assert apart.length == [100, 100] and apart.callers([1]) == [1]
    u = lambda *v: np.array(v, dtype=np.uint64)  # noqa: E731
    one = Spans(u(0, 8192), u(0, 8192), u(4096, 4096), [[7]], [[5]])  # the array path: one key for all
    assert [list(map(int, a)) for a in one.path([1], 0, 0)] == [[8192], [7], [8192], [5], [4096]]
    assert one.callers([0, 1]) == [0, 1]


def test_spans_cut_for_striping_keep_naming_their_entries():
    s = coalesce([0, 100, 500], [0, 100, 900], [100, 150, 10], [(1,)] * 3, [(2,)] * 3)
    c = s.cut(100)  # spans [0, 250) (entries 0, 1) and [500, 510) (entry 2)
    assert c.length.tolist() == [100, 100, 50, 10] and c.laddr.tolist() == [0, 100, 200, 500]
    assert c.raddr.tolist() == [0, 100, 200, 900] and c.callers([1]) == [0, 1] and c.callers([3]) == [2]
    assert c.callers([0, 2]) == [0, 1]  # each entry once


def test_the_native_route_table_takes_no_batch_it_cannot_check():
    """rdma_fast.py's table on a host without a device (no route can exist): whatever TransferEngine's entry hands
    it (odd region ids, columns, timeouts, digests, None) comes back 0, untaken, never an exception, so the
    general path names the problem; regions come and go."""
    from kvplugins.transfer import rdma_verbs

    if rdma_verbs.load_error() and "built without" in rdma_verbs.load_error():
        pytest.skip(rdma_verbs.load_error())
    fast = rdma_verbs.fast_routes(1 << 20, 8, 16, 5000.0)
    buf = np.zeros(8192, np.uint8)
    fast.add_local(7, buf.ctypes.data, buf.nbytes, False, [0x1234])
    odd = [
        (None, 0, [buf.ctypes.data], [0], [4096]),
        (object(), "0", [buf.ctypes.data], [0], [4096]),
        (object(), -1, [buf.ctypes.data], [0], [4096]),
        (object(), 2**70, [buf.ctypes.data], [0], [4096]),
        (object(), 0, [-1], [0], [4096]),
        (object(), 0, [1.5], [0], [4096]),
        (object(), 0, np.zeros(2), [0], [4096]),
        (object(), 0, [buf.ctypes.data] * 9, [0] * 9, [1] * 9),
        (object(), 0, None, None, None),
    ]
    for args in odd:
        assert fast.read(*args) == 0 and fast.write(*args, 0) == 0 and fast.write(*args, None, np.zeros(3)) == 0
    assert fast.run(True, object(), 0, [buf.ctypes.data], [0], [4096], 0.0) == 0
    fast.drop_local(7)
    fast.drop_routes("nobody")
    fast.clear()
    assert fast.counts() == (0, 0, 0, 0, 0)
