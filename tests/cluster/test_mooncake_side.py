"""mooncake_side.py against the real Mooncake 0.3.13 (its wheel and ``mooncake_master``): a master, two store nodes
(``python -m tests.cluster.mooncake_side node``) and a ``MooncakeStore`` client, each on its own address
(10.99.0.2-5 on ``lo``) inside a private network namespace (``unshare -n``: Mooncake's servers bind 0.0.0.0 where
not told otherwise, and the addresses must not leak). The scenario runs as this module's ``__main__`` under
``unshare -n`` in its own process group, prints its observations as one JSON line, and the test asserts them; every
process of the group is killed at the end, which also ends the namespace.

What the real Mooncake did (master flags at their defaults: ``--client_ttl=10``, ``--default_kv_lease_ttl=10000``;
puts with 2 replicas on 2 nodes, so every object has one replica on each):

* A miss: ``get_batch`` gives ``b""`` (``get_size`` -704 OBJECT_NOT_FOUND, ``batch_is_exist`` 0); a read error also
  gives ``b""``: MooncakeStore tells them apart with ``batch_is_exist``.
* SIGKILL of a store node: the master keeps the node's segment mounted until its heartbeats have been missing for
  ``--client_ttl`` (unmounted about 10-11 s after the kill; master log ``action=client_expired`` /
  ``unmount_expired_mem_segment``). Until then:

  - a read of an object whose *first* replica (the order the master returns them; the client reads that one,
    ``Client::GetPreferredReplica``, no local segment) is on the dead node fails (TRANSFER_FAIL -800 in the log,
    ``b""`` to Python, recorded as an error) on every try: the client does not fail over to the live second
    replica. Objects whose first replica is on the live node read fine. No miss, no wrong bytes.
  - ``batch_is_exist`` / exists_prefix still says the objects exist.
  - a put with 2 replicas fails for the whole batch (-800 TRANSFER_FAIL: one replica is allocated on the dead
    segment), and leaves nothing (its keys read as misses afterwards).

  After the unmount every object reads again from its surviving replica, and a put asking for 2 replicas succeeds
  with only 1 (Mooncake places what it can, silently).
* A store node with an unreachable master: ``setup`` retries (``MC_STORE_CLIENT_SETUP_RETRIES``, default 20, about
  4.6 s each, so about 90 s) and then returns -1; the node exits 1 without writing its ready file. (The same holds
  for a ``MooncakeStore`` opened while the master is unreachable.)
* SIGTERM of a store node: it closes its store and exits 0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import mooncake_side as ms

REPO = Path(__file__).resolve().parents[2]
MASTER_IP, NODE_IPS, CLIENT_IP = "10.99.0.2", ("10.99.0.3", "10.99.0.4"), "10.99.0.5"
RPC_PORT, META_PORT, METRICS_PORT = 50051, 8080, 9003
CLIENT_TTL_S = 10  # the master's --client_ttl (Mooncake's default)
SEGMENT = 64 << 20


def _mooncake_missing() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means no Mooncake here
        return f"mooncake.store is not importable: {e!r}"
    try:
        ms.master_binary()
    except FileNotFoundError as e:
        return str(e)
    return None


def test_master_string_round_trips_and_rejects_a_bare_address():
    m = ms.master_address("10.99.0.2", 50051, 8080)
    assert m == "10.99.0.2:50051|http://10.99.0.2:8080/metadata"
    assert ms.parse_master(m) == ("10.99.0.2:50051", "http://10.99.0.2:8080/metadata")
    with pytest.raises(ValueError, match="is not"):
        ms.parse_master("10.99.0.2:50051")


def test_master_command_binds_the_host_and_states_the_lease_flags():
    argv = ms.master_command("10.99.0.2", 50051, 8080, 9003, binary="mooncake_master")
    assert argv[0] == "mooncake_master"
    flags = dict(a[2:].split("=", 1) for a in argv[1:])
    assert {flags[k] for k in ("rpc_address", "http_metadata_server_host", "metrics_host")} == {"10.99.0.2"}
    assert (flags["rpc_port"], flags["http_metadata_server_port"], flags["metrics_port"]) == ("50051", "8080", "9003")
    assert flags["client_ttl"] == "10" and flags["default_kv_lease_ttl"] == "10000"
    assert flags["enable_metadata_cleanup_on_timeout"] == "false"
    assert "--client_ttl=3" in ms.master_command("h", 1, 2, 3, client_ttl_s=3, binary="m")


def test_ha_masters_elect_in_etcd_and_clients_find_them_there():
    m = ms.ha_master_address("10.99.0.1:2379;10.99.0.2:2379")
    assert ms.parse_master(m) == ("etcd://10.99.0.1:2379;10.99.0.2:2379", "P2PHANDSHAKE")
    with pytest.raises(ValueError, match="is not"):
        ms.parse_master("10.99.0.2:50051|P2PHANDSHAKE")  # not a layout of ours
    argv = ms.master_command("10.99.0.3", 50051, 8080, 9003, etcd_endpoints="10.99.0.1:2379", binary="m")
    flags = dict(a[2:].split("=", 1) for a in argv[1:])
    assert flags["enable_ha"] == "true" and flags["etcd_endpoints"] == "10.99.0.1:2379"
    assert flags["enable_oplog"] == "true"  # metadata reaches the standby (off: a new leader starts empty)
    assert flags["rpc_address"] == "10.99.0.3" and "enable_http_metadata_server" not in flags


def test_mooncake_error_names_the_code():
    assert str(ms.MooncakeError("put_batch", -800)) == "mooncake put_batch: code -800 (TRANSFER_FAIL)"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_real_mooncake_put_get_and_a_killed_node(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: the cluster runs in a private network namespace (unshare -n)")
    missing = _mooncake_missing()
    if missing:
        pytest.skip(missing)
    if not (shutil.which("unshare") and shutil.which("ip")):
        pytest.skip("needs unshare and ip (util-linux, iproute2)")
    proc = subprocess.Popen(
        ["unshare", "-n", sys.executable, "-m", "tests.cluster.test_mooncake_side", str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the master and nodes are killed with it
    )
    try:
        out, _ = proc.communicate(timeout=100)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, out[-6000:]
    o = json.loads(lines[-1][len("RESULT ") :])

    assert o["put"] == [None, None, None]
    assert (o["exists_prefix"], o["exists_prefix_unknown_first"]) == (3, 0)
    assert o["get"] == ["ok", "ok", "ok", "miss"]
    r = o["replay"]  # the trace replay's pool on Mooncake (run.py replays the trace on both stores)
    assert r.get("requests") == 40 and r["wrong_bytes"] == 0 and r["store_errors"] == 0, r
    assert r["pool_hit_ratio"] > 0 and r["puts"] > 0 and r["put_failures"] == 0, r
    assert o["raw_miss"] == {"get_batch": [""], "get_size": -704, "is_exist": 0}
    nodes = {ep.split(":")[0] for eps in o["replicas"].values() for ep in eps}
    assert nodes == set(NODE_IPS) and all(len({e.split(":")[0] for e in eps}) == 2 for eps in o["replicas"].values())

    # the window: the dead node's segment still mounted
    victim = o["victim_ip"]
    assert o["replicas"][o["keys"][0]][0].startswith(victim + ":")
    assert all("TRANSFER_FAIL" in e for e in o["put_window"]), o["put_window"]
    assert o["exists_window"] == 3
    on_victim = [o["replicas"][k][0].startswith(victim + ":") for k in o["keys"]]
    before = [r for r in o["reads"] if r["t"] < o["healed_at"]]
    assert before, o["reads"]
    for r in before:  # first replica dead -> an error every time; no failover, no miss, no wrong bytes
        assert [v.startswith("error") for v in r["verdicts"]] == on_victim, r
        assert all(v == "ok" for v, dead in zip(r["verdicts"], on_victim) if not dead), r
    assert CLIENT_TTL_S - 2 <= o["healed_at"] <= CLIENT_TTL_S + 8, o["reads"]

    # after the master unmounted it: every object reads from its surviving replica
    assert o["get_after"] == ["ok", "ok", "ok"]
    assert o["window_keys_after"] == ["miss"] * len(o["window_keys_after"])
    assert o["put_after"] == [None, None] and o["replicas_after"] == [1, 1]  # 2 asked, 1 placed
    assert o["survivor_rc"] == 0
    assert o["bad_master_rc"] == 1 and not o["bad_master_ready"]


# ----------------------------------------------------------------------------------------------- the scenario
# (runs as ``unshare -n python -m tests.cluster.test_mooncake_side WORKDIR``)


def _wait_port(host: str, port: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{host}:{port} never opened")


def _verdict(key: str, v: bytes | None | Exception) -> str:
    from tests.cluster.history import digest_of, value_of

    if v is None:
        return "miss"
    if isinstance(v, Exception):
        return f"error: {v}"
    return "ok" if digest_of(v) == digest_of(value_of(key)) else "wrong"


def _node(work: Path, master: str, ip: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    ready = work / f"{ip}.ready"
    log = open(work / f"node-{ip}.log", "w")
    cmd = [sys.executable, "-m", "tests.cluster.mooncake_side", "node", "--master", master, "--host-ip", ip]
    cmd += ["--segment-size", str(SEGMENT), "--ready-file", str(ready)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log, env=env), ready


def _replay(work: Path, master: str) -> dict:
    """``mooncake_side replay`` of a 40-request synthetic trace (two engine instances, Mooncake's client as the
    pool, as the cluster runs replay on Mooncake): its result row."""
    out = work / "replay.json"
    cmd = [sys.executable, "-m", "tests.cluster.mooncake_side", "replay", "--synth", "--synth-requests", "40",
           "--master", master, "--host-ip", CLIENT_IP, "--realtime", "--speed", "1000", "--instances", "2",
           "--miss-on-store-error", "--no-progress", "--scale", "65536", "--json", str(out)]  # fmt: skip
    with open(work / "replay.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=log, timeout=60).returncode
    if rc != 0 or not out.exists():
        return {"rc": rc, "log": (work / "replay.log").read_text()[-3000:]}
    return json.loads(out.read_text())["results"][0]


def scenario(work: Path) -> dict:
    from tests.cluster.history import page_key, value_of

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    for ip in (MASTER_IP, *NODE_IPS, CLIENT_IP):
        subprocess.run(["ip", "addr", "add", f"{ip}/32", "dev", "lo"], check=True)
    master = ms.master_address(MASTER_IP, RPC_PORT, META_PORT)
    procs: list[subprocess.Popen] = []
    o: dict = {}
    try:
        mlog = open(work / "master.log", "w")
        argv = ms.master_command(MASTER_IP, RPC_PORT, META_PORT, METRICS_PORT, client_ttl_s=CLIENT_TTL_S)
        procs.append(subprocess.Popen(argv, stdout=mlog, stderr=mlog))
        _wait_port(MASTER_IP, RPC_PORT)
        _wait_port(MASTER_IP, META_PORT)
        nodes = {ip: _node(work, master, ip) for ip in NODE_IPS}
        procs += [p for p, _ in nodes.values()]
        deadline = time.monotonic() + 30
        while not all(ready.exists() for _, ready in nodes.values()):
            dead = [ip for ip, (p, _) in nodes.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"store nodes not ready (exited: {dead})")
            time.sleep(0.05)

        store = ms.MooncakeStore(master, CLIENT_IP, 2)
        keys = [page_key("t", "c0", i, size) for i, size in enumerate((64 << 10, 1 << 20, 4 << 20))]
        unknown = page_key("t", "nowhere", 0, 64 << 10)
        o["keys"] = keys
        o["put"] = [None if e is None else repr(e) for e in store.batch_put(keys, [value_of(k) for k in keys])]
        o["exists_prefix"] = store.exists_prefix(keys + [unknown])
        o["exists_prefix_unknown_first"] = store.exists_prefix([unknown] + keys)
        o["get"] = [_verdict(k, v) for k, v in zip(keys + [unknown], store.batch_get(keys + [unknown]))]
        raw = store._s
        o["raw_miss"] = {
            "get_batch": [b.decode() for b in raw.get_batch([unknown])],
            "get_size": raw.get_size(unknown),
            "is_exist": raw.is_exist(unknown),
        }
        o["replicas"] = {
            k: [r.get_memory_descriptor().buffer_descriptor.transport_endpoint for r in raw.get_replica_desc(k)]
            for k in keys
        }
        o["replay"] = _replay(work, master)

        # SIGKILL the node that holds the first replica of keys[0] (the one its reads go to)
        victim = o["replicas"][keys[0]][0].split(":")[0]
        o["victim_ip"] = victim
        nodes[victim][0].kill()
        killed = time.monotonic()
        window = [page_key("t", "w", i, 64 << 10) for i in range(3)]
        o["put_window"] = [repr(e) for e in store.batch_put(window, [value_of(k) for k in window])]
        o["exists_window"] = store.exists_prefix(keys)
        o["reads"], o["healed_at"] = [], None
        while time.monotonic() - killed < CLIENT_TTL_S + 15:
            t = time.monotonic() - killed
            verdicts = [_verdict(k, v) for k, v in zip(keys, store.batch_get(keys))]
            o["reads"].append({"t": round(t, 2), "verdicts": verdicts})
            if all(v == "ok" for v in verdicts):
                o["healed_at"] = round(t, 2)
                break
            time.sleep(0.5)
        o["get_after"] = [_verdict(k, v) for k, v in zip(keys, store.batch_get(keys))]
        o["window_keys_after"] = [_verdict(k, v) for k, v in zip(window, store.batch_get(window))]
        after = [page_key("t", "after", i, 64 << 10) for i in range(2)]
        o["put_after"] = [None if e is None else repr(e) for e in store.batch_put(after, [value_of(k) for k in after])]
        o["replicas_after"] = [len(raw.get_replica_desc(k)) for k in after]
        store.close()

        survivor = nodes[next(ip for ip in NODE_IPS if ip != victim)][0]
        survivor.send_signal(signal.SIGTERM)
        o["survivor_rc"] = survivor.wait(20)

        # a node whose master does not answer (one setup retry instead of 20)
        bad, ready = _node(
            work,
            f"{MASTER_IP}:1|http://{MASTER_IP}:2/metadata",
            "10.99.0.5",
            {
                **os.environ,
                "MC_STORE_CLIENT_SETUP_RETRIES": "1",
            },
        )
        procs.append(bad)
        o["bad_master_rc"] = bad.wait(30)
        o["bad_master_ready"] = ready.exists()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return o


if __name__ == "__main__":
    result = scenario(Path(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
