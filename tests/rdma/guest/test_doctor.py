"""``kvplugins doctor`` on real soft-RoCE devices: rxe0 and rxe1 on eth0 and eth1 of the QEMU guest
(ci/rxe-guest.sh --nics 2, each ethI with 10.77.I.15/24), run as a real process."""

import json
import subprocess
import sys
from pathlib import Path


def test_doctor_lists_both_rxe_ports_active_with_ipv4_mapped_roce_v2_gids():
    script = Path(sys.executable).with_name("kvplugins")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvplugins.cli"]
    res = subprocess.run(cmd + ["doctor", "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    rdma = report["rdma"]
    assert rdma["available"] and rdma["problems"] == [] and "rdma" in report["available"]
    by_name = {n["name"]: n for n in rdma["nics"]}
    for i in (0, 1):
        nic = by_name[f"rxe{i}"]
        assert (nic["port"], nic["state"], nic["link_layer"], nic["gid_type"]) == (1, "ACTIVE", "Ethernet", "RoCE v2")
        assert nic["gid"] == f"0000:0000:0000:0000:0000:ffff:0a4d:{i:02x}0f"  # ::ffff:10.77.<i>.15
        assert (nic["netdev"], nic["ipv4"]) == (f"eth{i}", f"10.77.{i}.15/24")
        assert nic["active_mtu"] == 1024 and nic["usable"]  # a 1500-byte Ethernet MTU
        assert nic["pci"] and nic["speed_gbps"] == 2.5
