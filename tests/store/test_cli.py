"""The store commands read flags, env and --config files through the component configs (real processes)."""

import json
import os
import subprocess

from helpers.cluster import master_process, store_cluster
from kvplugins.store.embedded import CLI
from kvplugins.store.client.rpc import RawRpcClient


def test_master_takes_settings_from_config_file_and_env(tmp_path):
    cfg = tmp_path / "kvp.toml"
    port_file = tmp_path / "m.port"
    cfg.write_text(f'[master]\nlease_ttl_ms = 1234\nport_file = "{port_file}"\n')
    env = {**os.environ, "KVPLUGINS_MASTER_PUT_TIMEOUT_MS": "4321"}
    proc = subprocess.Popen(
        CLI + ["master", "--config", str(cfg)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line
        rpc = RawRpcClient(port_file.read_text().strip(), 2000)
        info = rpc.call("info")
        assert info["lease_ttl_ms"] == 1234 and info["put_timeout_ms"] == 4321
        assert info["zmq"].startswith("tcp://127.0.0.1:")
        rpc.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_bad_flag_value_is_a_clear_error():
    proc = subprocess.run(
        CLI + ["master", "--high-watermark", "0.5", "--low-watermark", "0.9"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "low_watermark" in proc.stderr


def test_status_json_lists_segments():
    with store_cluster(nodes=2, segment_size="2MiB") as c:
        out = subprocess.run(
            CLI + ["status", "--master", c.master, "--json"], capture_output=True, text=True, timeout=30
        )
        st = json.loads(out.stdout)
        assert sorted(s["name"] for s in st["segments"]) == sorted(n.address for n in c.nodes)
        assert st["bytes_total"] == 2 * (2 << 20) and st["objects"] == 0


def test_store_node_without_master_fails_fast(tmp_path):
    env = {**os.environ, "KVPLUGINS_UP_DISCOVERY_FILE": str(tmp_path / "none.json")}
    proc = subprocess.run(
        CLI + ["store", "--segment-size", "1MiB"], capture_output=True, text=True, timeout=30, env=env
    )
    assert proc.returncode == 2 and "--master" in proc.stderr


def test_master_unreachable_for_status_names_address():
    with master_process() as m:
        addr = m.address
    proc = subprocess.run(
        CLI + ["status", "--master", addr, "--rpc-timeout-ms", "300"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and addr in proc.stderr and "300 ms" in proc.stderr
