"""The soft-RoCE guest itself (ci/rxe-guest.sh --nics 2): the native verbs layer opens rxe0 and rxe1 with port 1
ACTIVE, a port follows its netdev's link down and up, and perftest's ib_write_bw runs between two processes over
rxe0."""

import re
import subprocess
import time

import pytest

from kvplugins.transfer import rdma_verbs

PERFTEST_PORT = 18777
PORT_DOWN, PORT_ACTIVE = 1, rdma_verbs.PORT_ACTIVE  # enum ibv_port_state


def port_state(device: str) -> int:
    return rdma_verbs.query_ports(device, [1])[0][0]


def wait_state(device: str, want: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while port_state(device) != want:
        assert time.monotonic() < end, f"{device} port 1 state {port_state(device)}, wanted {want}"
        time.sleep(0.2)


def test_both_rxe_devices_open_with_port_1_active(rxe_devices):
    assert rxe_devices == ["rxe0", "rxe1"]
    for dev in rxe_devices:
        assert port_state(dev) == PORT_ACTIVE, dev


def test_port_follows_link_down_and_up(nic_link):
    nic_link("eth1", "down")
    wait_state("rxe1", PORT_DOWN)
    nic_link("eth1", "up")
    wait_state("rxe1", PORT_ACTIVE)


@pytest.mark.timeout(600)
def test_ib_write_bw_between_two_processes(roce_v2_gid):
    args = [
        "ib_write_bw",
        "-d",
        "rxe0",
        "-x",
        str(roce_v2_gid("rxe0")),
        "-s",
        "65536",
        "-n",
        "50",
        "-F",
        "-p",
        str(PERFTEST_PORT),
    ]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 60
        while not subprocess.run(
            ["ss", "-Hltn", f"sport = :{PERFTEST_PORT}"], capture_output=True, text=True
        ).stdout.strip():
            assert server.poll() is None and time.monotonic() < end, "ib_write_bw server did not listen"
            time.sleep(0.2)
        client = subprocess.run(args + ["10.77.0.15"], capture_output=True, text=True, timeout=300)
        server_out, _ = server.communicate(timeout=120)
    finally:
        server.kill()
    print(client.stdout, client.stderr, server_out, sep="\n")
    assert client.returncode == 0 and server.returncode == 0
    # the result row appears once all 50 writes completed; its BW comes from the guest's TSC rate, which TCG
    # emulation can misreport (0.00 MB/s printed on an AMD EPYC host), so it is shown, not asserted
    row = re.search(r"^\s*65536\s+50\s+(\S+)\s+(\S+)", client.stdout, re.M)
    assert row, client.stdout
