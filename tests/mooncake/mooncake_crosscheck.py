"""Run test_mooncake_api.mooncake_style_script against the REAL Mooncake 0.3.13 (mooncake_master + two segment
processes of the installed wheel), to prove the script's expected return codes are Mooncake's own.

Must run inside a private network namespace (``unshare -n``; Mooncake's servers bind 0.0.0.0): it brings ``lo``
up, starts everything on 127.0.0.1 and kills it all at the end. Prints "SCRIPT OK" on success.

    unshare -n python tests/mooncake/mooncake_crosscheck.py [segment]
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
META, MASTER = "http://127.0.0.1:8080/metadata", "127.0.0.1:50051"


def segment() -> None:
    """A process that only contributes a 64 MiB segment (Mooncake's client mounts it at setup)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    print("setup rc", store.setup("127.0.0.1", META, 64 << 20, 16 << 20, "tcp", "", MASTER), flush=True)
    time.sleep(300)


def wait_port(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"port {port} never opened")


def main() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    master = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mooncake_master"),
            "--rpc_port=50051",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_port=8080",
            "--http_metadata_server_host=127.0.0.1",
            "--metrics_port=9003",
            "--enable_metric_reporting=false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    procs = [master]
    try:
        wait_port(50051)
        wait_port(8080)
        segs = [
            subprocess.Popen(
                [sys.executable, __file__, "segment"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            for _ in range(2)
        ]
        procs += segs
        for s in segs:
            line = s.stdout.readline()
            if line.strip() != "setup rc 0":
                raise SystemExit(f"segment setup failed: {line!r}")
        sys.path[:0] = [str(HERE), str(HERE.parent)]
        import mooncake.store
        import test_mooncake_api
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        test_mooncake_api.ReplicateConfig = ReplicateConfig  # the script builds Mooncake's own config object
        test_mooncake_api.mooncake_style_script(_Localhost(MooncakeDistributedStore()), MASTER)
        test_mooncake_api.mooncake_more_script(
            _Localhost(MooncakeDistributedStore()), MASTER, lambda: _Localhost(MooncakeDistributedStore())
        )
        pooled = MooncakeDistributedStore()
        assert _Localhost(pooled).setup("localhost", META, 0, 16 << 20, "tcp", "", MASTER) == 0
        test_mooncake_api.mooncake_pool_script(pooled, mooncake.store.BufferPool)
        test_mooncake_api.mooncake_replica_clear_script(
            _Localhost(MooncakeDistributedStore()), MASTER, ReplicateConfig, 10.2
        )  # its default 10 s read lease
        import test_mooncake_tasks

        test_mooncake_tasks.mooncake_tasks_script(_Localhost(MooncakeDistributedStore()), MASTER, ReplicateConfig)
        import test_mooncake_parallel

        test_mooncake_parallel.mooncake_parallel_script(_Localhost(MooncakeDistributedStore()), MASTER, mooncake.store)
        print("SCRIPT OK", flush=True)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


class _Localhost:
    """The store, with setup's metadata server pointed at the one started here (our store ignores it)."""

    def __init__(self, store):
        self._store = store

    def setup(self, host, metadata=None, *rest):
        if isinstance(host, dict):
            return self._store.setup({**host, "local_hostname": "127.0.0.1", "metadata_server": META})
        return self._store.setup("127.0.0.1", META, *rest)

    def __getattr__(self, name):
        return getattr(self._store, name)


if __name__ == "__main__":
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    segment() if sys.argv[1:] == ["segment"] else main()
