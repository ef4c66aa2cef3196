"""The store on a namespace cluster under the nemesis (issue #34): a short seeded schedule with every fault kind
once, checked offline. 6 hosts (etcd; an HA master pair; 3 store nodes; 5 workload clients, puts with 2
replicas), 5 s faults (2.5x the master's 2 s heartbeat timeout; SIGSTOPs 10 s), 3 s of calm between them.

Asserts the checker's verdict: no wrong byte, no acknowledged object lost without every replica's node killed,
no crash, no shared-memory byte between hosts; and that the faults were applied and the workload ran through them.
Longer runs: ``python -m tests.cluster.run --minutes 10``.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.cluster import run
from tests.cluster.nemesis import KINDS

pytestmark = pytest.mark.slow


def _tools() -> list[str]:
    return [t for t in ("ip", "nft", "iptables", "etcd", "unshare", "tc") if shutil.which(t) is None]


@pytest.mark.timeout(600)
def test_every_fault_kind_once_loses_nothing_and_never_returns_wrong_bytes(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    assert not _tools(), f"missing {_tools()}: run `bash ci/install.sh` (apt packages iproute2 nftables iptables etcd)"
    args = run.parse(["--hosts", "6", "--minutes", "0", "--seed", "34", "--duration", "5", "--gap", "3",
                      "--out", str(tmp_path)])  # fmt: skip
    verdict = run.run(args)
    print(verdict.table())
    assert verdict.ok, verdict.table()
    assert set(verdict.kinds) == set(KINDS)
    assert verdict.acknowledged > 100 and verdict.ops > 5000, verdict.table()
    assert sum(r.failed for r in verdict.kinds.values()) > 0, "no fault made any operation fail: were they applied?"
