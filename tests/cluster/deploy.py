"""A store deployed over the hosts of a Net (net.py): what runs where, started, restarted and stopped as processes
of their hosts, all with the cluster secret (every bind is non-loopback).

kvplugins' layout, ``Deployment(net, tmp)`` with N >= 5 hosts:
  h1          an etcd member (the masters' election and journal: a three-member etcd on h1, h2 and h3)
  h2, h3      an etcd member and `kvplugins master --etcd` (an HA pair) + a workload client each (engine hosts
              without a node)
  h4 .. hN    `kvplugins store` (a DRAM node) + a workload client each (engine hosts with a node)
Clients and nodes take ``etcd://10.99.0.1:2379,10.99.0.2:2379,10.99.0.3:2379`` as their master address and follow
the leader. With ``disk_mib``, every node also has a disk tier on its own tmpfs (``tmp/disk<i>``, unmounted by
``stop()``) and the masters' watermarks make the sweep offload most objects, so reads promote from disk.

Mooncake's layout (``system="mooncake"``), the same hosts doing the same jobs with Mooncake 0.3.13's own processes
(mooncake_side.py): h2 runs ``mooncake_master`` with its HTTP metadata server, h3 only a client, h4 .. hN a
segment-only Mooncake process each (its store node), clients on h2 .. hN; h1 stays idle. With ``mooncake_ha``,
Mooncake's HA pair instead: etcd on h1 .. h3 as for kvplugins, ``mooncake_master --enable_ha --enable_oplog`` on
h2 and h3 (the leader elected in etcd, its metadata replicated to the standby), clients and nodes finding it
through etcd, transfer metadata P2PHANDSHAKE. Every process
writes its log to ``tmp/<name>.log``; ``procs`` maps name -> Proc with its role and host, which the nemesis picks
its targets from. Ports are fixed inside the namespaces (each has its own port space; nothing can collide).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.cluster import mooncake_side
from tests.cluster.net import Net

ETCD_PORT, MASTER_PORT = 2379, 7100
SHARD_PUT_TIMEOUT_MS = 10_000  # a joining shard waits for the nodes' hand-over: lease TTL (5 s) + this
SHARD_IDS, SPARE_SHARD = "abcdefgz", "z"  # shard z is the one that joins and leaves (nemesis: shard_move)
SHARD_PREFIX, MOVE_WINDOW_MS = "/kvplugins/cluster", 4000
REPLAY_SCALE = 65536  # replay objects of 1 KiB (llama3-8b's 64 MiB blocks / 65536): the whole trace, 2 replicas,
# holds ~0.4 GB, so the 1.5 GiB of three nodes never evicts (an eviction is a miss the checker cannot tell from loss)
MOONCAKE_RPC_PORT, MOONCAKE_META_PORT, MOONCAKE_METRICS = 50051, 8080, 9003
START_TIMEOUT_S = 60.0
KVP = [sys.executable, "-c", "import sys; from kvplugins.cli import main; sys.exit(main())"]


@dataclass
class Proc:
    """One process of the deployment. ``killed``: the nemesis killed it (so its exit is no crash)."""

    name: str
    role: str  # etcd | master | node | client | replay
    host: int
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of the deployment's
    popen: subprocess.Popen | None = None
    killed: int = 0
    stopped: bool = False
    exits: list[int] = field(default_factory=list)  # return codes of earlier incarnations

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            self.popen.send_signal(sig)

    def log_tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class Deployment:
    """Starts etcd, the HA master pair, the nodes and the workload clients on ``net``; ``stop()`` stops all."""

    def __init__(
        self,
        net: Net,
        tmp: Path,
        run: str,
        seed: int,
        system: str = "kvplugins",
        segment_mib: int = 512,
        spare: int = 0,
        disk_mib: int = 0,
        shards: tuple[str, ...] = (),
        mooncake_ha: bool = False,
    ):
        if net.n - spare < 5:
            raise ValueError(f"hosts={net.n}: a deployment needs >= 5 (etcd, 2 masters, 2 nodes for 2 replicas)")
        if system not in ("kvplugins", "mooncake"):
            raise ValueError(f"system={system!r}: use 'kvplugins' or 'mooncake'")
        self.net, self.tmp, self.run, self.seed, self.system = net, tmp, run, seed, system
        self.segment_mib, self.spare = segment_mib, spare  # spare: the last hosts run nothing of the store
        if disk_mib and system != "kvplugins":
            raise ValueError("disk_mib: the disk tier layout is kvplugins' (Mooncake's is not deployed here)")
        self.disk_mib = disk_mib  # > 0: each node has a disk tier on a tmpfs of this size (disk_dir)
        self.mounts: list[Path] = []
        if shards and (system != "kvplugins" or disk_mib):
            raise ValueError("shards: kvplugins' sharded layout has no disk tier (a sharded node refuses one)")
        if bad := [sid for sid in shards if sid not in SHARD_IDS or sid == SPARE_SHARD]:
            raise ValueError(f"shard ids {bad}: use letters of {SHARD_IDS[:-1]!r} ({SPARE_SHARD!r} joins and leaves)")
        self.shards = tuple(shards)  # sharded layout: each an HA pair on h2 and h3
        self.procs: dict[str, Proc] = {}
        token = tmp / "token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = {**os.environ, "KVPLUGINS_AUTH_TOKEN_FILE": str(token), "PYTHONUNBUFFERED": "1"}
        self.etcd_hosts = [1, 2, 3]  # a three-member etcd: losing one coordination host is survivable
        self.etcd_urls = ",".join(f"http://{net.ip(i)}:{ETCD_PORT}" for i in self.etcd_hosts)
        self.master = "etcd://" + ",".join(f"{net.ip(i)}:{ETCD_PORT}" for i in self.etcd_hosts)
        if mooncake_ha and system != "mooncake":
            raise ValueError("mooncake_ha: the HA master pair of Mooncake's layout (kvplugins' is always HA)")
        self.mooncake_ha = mooncake_ha  # Mooncake's masters on h2 and h3 electing in etcd, metadata P2PHANDSHAKE
        self.mooncake_etcd = ";".join(f"{net.ip(i)}:{ETCD_PORT}" for i in self.etcd_hosts)
        if system == "mooncake":
            self.master = (
                mooncake_side.ha_master_address(self.mooncake_etcd)
                if mooncake_ha
                else mooncake_side.master_address(net.ip(2), MOONCAKE_RPC_PORT, MOONCAKE_META_PORT)
            )
        if shards:
            self.master = self.master.replace("etcd://", "shards://") + SHARD_PREFIX
        self.stop_file = tmp / "stop"

    # ---- layout -------------------------------------------------------------------------------------
    def masters(self) -> list[int]:
        return [2, 3] if self.system == "kvplugins" or self.mooncake_ha else [2]

    def node_hosts(self) -> list[int]:
        return list(range(4, self.net.n + 1 - self.spare))

    def client_hosts(self) -> list[int]:
        return list(range(2, self.net.n + 1 - self.spare))

    def start(self, clients: bool = True) -> None:
        """Start everything of the layout; ``clients=False``: no workload clients (a test brings its own)."""
        if self.system == "mooncake":
            return self._start_mooncake(clients)
        self._start_etcd()
        for sid in self.shards:
            self.add_shard(sid)
        for i in self.masters() if not self.shards else ():
            self._add("master", i, [*KVP, "master", "--etcd", self.etcd_urls,
                                    "--host", self.net.ip(i), "--port", str(MASTER_PORT), *self._tiering()])  # fmt: skip
        self._wait_leader()
        for i in self.node_hosts():
            ready = self.tmp / f"node{i}.ready"
            self._add("node", i, [*KVP, "store", "--master", self.master, "--host", self.net.ip(i),
                                  "--segment-size", f"{self.segment_mib}MiB", "--ready-file", str(ready),
                                  *self._disk(i)])  # fmt: skip
            self._wait_file(self.procs[f"node{i}"], ready)
        for i in self.client_hosts() if clients else ():
            self.add_client(i)

    # ---- the sharded layout ---------------------------------------------------------------------------
    def add_shard(self, sid: str) -> None:
        """Start (or restart) shard ``sid``'s HA pair on h2 and h3; it joins the ring once a leader is elected."""
        port = str(MASTER_PORT + SHARD_IDS.index(sid))
        for i in self.masters():
            name = f"master{i}{sid}"
            if name in self.procs:
                if not self.procs[name].alive():
                    self.spawn(self.procs[name])
                continue
            self._add("master", i, [*KVP, "master", "--cluster", self.master, "--shard", sid, "--etcd", self.etcd_urls,
                                    "--host", self.net.ip(i), "--port", port,
                                    "--shard-move-window-ms", str(MOVE_WINDOW_MS),
                                    "--put-timeout-ms", str(SHARD_PUT_TIMEOUT_MS)], name=name)  # fmt: skip

    def remove_shard(self, sid: str) -> None:
        """``kvplugins shard remove sid`` from host 2 (its keys move to the others); raises RuntimeError if refused."""
        out = subprocess.run(self.net.command(2, [*KVP, "shard", "remove", sid, "--master", self.master]),
                             capture_output=True, text=True, env=self.env, timeout=60)  # fmt: skip
        if out.returncode:
            raise RuntimeError(f"shard remove {sid}: {out.stderr[-500:]}")

    def retire_shard(self, sid: str) -> None:
        """Stop a removed shard's masters (SIGTERM: they exit 0)."""
        for i in self.masters():
            p = self.procs[f"master{i}{sid}"]
            p.signal(signal.SIGTERM)
            assert p.popen is not None
            p.popen.wait(timeout=30)

    def ring(self) -> dict:
        """The membership as seen from host 2: {"epoch", "members": [ids], "moving": bool, "leaders": {id: host}}."""
        code = (
            "import json\nfrom kvplugins.store.cluster.membership import Membership\n"
            "from kvplugins.store.client.follower import leader_info\n"
            f"st = Membership({self.master!r}).read()\nleaders = {{}}\n"
            "for sid in st.members:\n"
            f"    info = leader_info({self.master.replace('shards://', 'etcd://')!r} + '/shard/' + sid, 1500)\n"
            "    leaders[sid] = info['raw'] if info else ''\n"
            "print(json.dumps({'epoch': st.epoch, 'members': sorted(st.members), 'moving': st.moving(), "
            "'leaders': leaders}))"
        )
        out = json.loads(self.ask(code) or "{}") or {"epoch": -1, "members": [], "moving": True, "leaders": {}}
        ips = {self.net.ip(i): i for i in self.masters()}
        out["leaders"] = {sid: ips.get(raw.rpartition(":")[0]) for sid, raw in out["leaders"].items()}
        return out

    def leaders(self) -> list[Proc]:
        """The leader master of each shard (one for the unsharded layouts; none where no leader is known)."""
        if not self.shards:
            host = self.leader()
            return [self.procs[f"master{host}"]] if host is not None else []
        return [self.procs[f"master{h}{sid}"] for sid, h in self.ring()["leaders"].items() if h is not None]

    def _tiering(self) -> list[str]:
        """With a disk tier: watermarks low enough that the sweep offloads most objects, so reads promote from
        disk all the time (what a disk tier does in a full pool, without filling DRAM and dropping objects)."""
        return ["--high-watermark", "0.02", "--low-watermark", "0.01"] if self.disk_mib else []

    def _disk(self, i: int) -> list[str]:
        """The node's disk tier flags: its directory on a tmpfs of ``disk_mib`` (mounted once; a restarted node
        finds its files there), 3/4 of it as the tier's capacity (so only a fault fills the file system)."""
        if not self.disk_mib:
            return []
        path = self.disk_dir(i)
        if path not in self.mounts:
            path.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.disk_mib}m,mode=0700", "tmpfs", str(path)],
                           check=True)  # fmt: skip
            self.mounts.append(path)
        return ["--disk-dir", str(path / "tier"), "--disk-capacity", f"{self.disk_mib * 3 // 4}MiB"]

    def disk_dir(self, i: int) -> Path:
        return self.tmp / f"disk{i}"

    def _start_mooncake(self, clients: bool) -> None:
        if self.mooncake_ha:
            self._start_etcd()
        for i in self.masters():
            argv = mooncake_side.master_command(self.net.ip(i), MOONCAKE_RPC_PORT, MOONCAKE_META_PORT,
                                                MOONCAKE_METRICS, etcd_endpoints=self.mooncake_etcd if
                                                self.mooncake_ha else "")  # fmt: skip
            self._add("master", i, argv)
        self._wait_leader()
        for i in self.node_hosts():
            ready = self.tmp / f"node{i}.ready"
            self._add("node", i, [sys.executable, "-m", "tests.cluster.mooncake_side", "node", "--master", self.master,
                                  "--host-ip", self.net.ip(i), "--segment-size", str(self.segment_mib << 20),
                                  "--ready-file", str(ready)])  # fmt: skip
            self._wait_file(self.procs[f"node{i}"], ready)
        for i in self.client_hosts() if clients else ():
            self.add_client(i)

    def add_client(self, i: int, final: Path | None = None, name: str | None = None) -> Proc:
        name = name or f"client{i}"
        argv = [sys.executable, "-m", "tests.cluster.workload", "--master", self.master, "--host-ip", self.net.ip(i),
                "--client", name, "--host", f"h{i}", "--history", str(self.tmp / f"{name}.jsonl"), "--run", self.run,
                "--seed", str(self.seed), "--stop-file", str(self.stop_file), "--system", self.system]  # fmt: skip
        if final is not None:
            argv += ["--final", str(final)]
        return self._add("client", i, argv, name=name)

    def add_replay(self, i: int, trace: Path, limit: int, speed: float) -> Proc:
        """``kvplugins replay`` of ``trace``'s first ``limit`` requests at its arrival times / ``speed``, through
        the cluster from host i (two engine instances, 1 KiB objects, 2 replicas, the workload's timeouts; a store
        error is a counted miss, as in the connectors). Its result rows go to ``tmp/replay.json``. On Mooncake, the
        same replay with Mooncake's client as the pool (mooncake_side.py ``replay``)."""
        argv = ["replay", str(trace), "--master", self.master, "--realtime", "--speed", f"{speed:.3f}",
                "--limit", str(limit), "--instances", "2", "--miss-on-store-error", "--no-progress",
                "--scale", str(REPLAY_SCALE),
                "--json", str(self.tmp / "replay.json")]  # fmt: skip
        if self.system == "mooncake":
            argv = [sys.executable, "-m", "tests.cluster.mooncake_side", *argv, "--host-ip", self.net.ip(i)]
        else:
            argv = [*KVP, *argv]
        env = {"KVPLUGINS_CLIENT_HOST": self.net.ip(i), "KVPLUGINS_CLIENT_REPLICAS": "2",
               "KVPLUGINS_CLIENT_RPC_TIMEOUT_MS": "1000", "KVPLUGINS_CLIENT_TRANSFER_TIMEOUT_MS": "3000"}  # fmt: skip
        proc = Proc(f"replay{i}", "replay", i, argv, self.tmp / f"replay{i}.log", env)
        self.procs[proc.name] = proc
        self.spawn(proc)
        return proc

    def _start_etcd(self) -> None:
        peers = ",".join(f"h{i}=http://{self.net.ip(i)}:{ETCD_PORT + 1}" for i in self.etcd_hosts)
        for i in self.etcd_hosts:
            url = f"http://{self.net.ip(i)}"
            argv = ["etcd", "--name", f"h{i}", "--data-dir", str(self.tmp / f"etcd{i}"),
                    "--listen-client-urls", f"{url}:{ETCD_PORT}", "--advertise-client-urls", f"{url}:{ETCD_PORT}",
                    "--listen-peer-urls", f"{url}:{ETCD_PORT + 1}",
                    "--initial-advertise-peer-urls", f"{url}:{ETCD_PORT + 1}", "--initial-cluster", peers,
                    "--initial-cluster-state", "new", "--logger", "zap", "--log-level", "warn"]  # fmt: skip
            self._add("etcd", i, argv)

    # ---- processes ------------------------------------------------------------------------------------
    def _add(self, role: str, i: int, argv: list[str], name: str | None = None) -> Proc:
        name = name or f"{role}{i}"
        proc = Proc(name, role, i, argv, self.tmp / f"{name}.log")
        self.procs[name] = proc
        self.spawn(proc)
        return proc

    def spawn(self, proc: Proc) -> None:
        """(Re)start ``proc`` in its host; an earlier incarnation's exit code is kept in ``exits``."""
        if proc.popen is not None:
            proc.exits.append(proc.popen.wait(timeout=30))
        with open(proc.log, "ab") as log:
            proc.popen = subprocess.Popen(
                self.net.command(proc.host, proc.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env, **proc.env},
                cwd=Path(__file__).resolve().parents[2],
                start_new_session=True,
            )
        proc.stopped = False

    def _wait_file(self, proc: Proc, path: Path) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (path.exists() and path.read_text().strip()):
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} not ready:\n{proc.log_tail()}")
            time.sleep(0.05)

    def leader(self) -> int | None:
        """The host of the current leader master (asked from inside host 2), or None."""
        if self.mooncake_ha:  # the leader's address, which Mooncake keeps under a key ending in master_view
            code = (
                "from kvplugins.store.cluster.etcd import Etcd\n"
                f"kv = Etcd({self.etcd_urls!r}, 1.5).range_prefix('mooncake-store/')\n"
                "print(b' '.join(v for k, v in kv if k.endswith('master_view')).decode(errors='replace'))"
            )
        elif self.system == "mooncake":
            code = (
                f"import socket\ntry:\n socket.create_connection(({self.net.ip(2)!r}, {MOONCAKE_RPC_PORT}), 1).close()"
            )
            code += "\n print('up')\nexcept OSError:\n pass"
        else:
            code = (
                "from kvplugins.store.client.follower import leader_info\n"
                f"info = leader_info({self.master!r}, 1500)\nprint(info['raw'] if info else '')"
            )
        raw = self.ask(code)
        if self.mooncake_ha:
            return next((i for i in self.masters() if f"{self.net.ip(i)}:{MOONCAKE_RPC_PORT}" in raw), None)
        if self.system == "mooncake":
            return 2 if raw == "up" else None
        return next((i for i in self.masters() if raw.startswith(self.net.ip(i) + ":")), None)

    def _led(self) -> bool:
        if not self.shards:
            return self.leader() is not None
        ring = self.ring()
        return set(ring["members"]) == set(self.shards) and None not in ring["leaders"].values()

    def ask(self, code: str, host: int = 2, timeout_s: float = 30) -> str:
        """What Python ``code`` prints, run as a process of ``host`` with the cluster's secret (stripped)."""
        out = subprocess.run(self.net.command(host, [sys.executable, "-c", code]), capture_output=True, text=True,
                             env=self.env, timeout=timeout_s)  # fmt: skip
        return out.stdout.strip()

    def _wait_leader(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._led():
            if time.monotonic() > deadline:
                first = next(p for p in self.procs.values() if p.role == "master")
                raise RuntimeError("no master leader:\n" + first.log_tail())
            time.sleep(0.3)

    def stop_clients(self, timeout_s: float = 60.0) -> None:
        """Ask every workload client to stop (the stop file) and wait for them."""
        self.stop_file.touch()
        for p in self.procs.values():
            if p.role == "client" and p.popen is not None:
                if p.stopped:
                    p.signal(signal.SIGCONT)
                try:
                    p.popen.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()

    def stop(self) -> None:
        """SIGTERM every process (SIGCONT first) in an operator's order, clients first and etcd last, each role's
        processes at once; SIGKILL what is left of a role after 15 s."""
        for roles in (("client", "replay"), ("node",), ("master",), ("etcd",)):
            procs = [p for p in self.procs.values() if p.role in roles and p.popen is not None]
            for p in procs:
                p.signal(signal.SIGCONT)
                p.signal(signal.SIGTERM)
            for p in procs:
                assert p.popen is not None
                try:
                    p.popen.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()
        for path in self.mounts:
            subprocess.run(["umount", "-l", str(path)], check=False)
        self.mounts.clear()
