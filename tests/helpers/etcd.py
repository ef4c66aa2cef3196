"""A real etcd (Debian ``etcd-server`` 3.4, installed by ``bash ci/install.sh``) for tests: started on free
loopback ports (found by binding port 0) with a temp data dir, waited for, and SIGKILLed on exit.

    with etcd_server() as e:
        e.url        # "http://127.0.0.1:PORT" (client URL; what `kvplugins master --etcd` takes)
        e.endpoint   # "etcd://127.0.0.1:PORT" (what clients and nodes take as their master address)
        e.stop(); e.start()   # an outage: SIGKILL, then the same ports and data dir again

Outside CI a missing ``etcd`` binary fails with a message naming ``bash ci/install.sh``; nothing is skipped.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 20.0


@dataclass
class Etcd:
    url: str
    popen: subprocess.Popen
    log: Path
    args: list

    @property
    def endpoint(self) -> str:
        return "etcd://" + self.url.removeprefix("http://")

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        """SIGKILL etcd (an outage); ``start()`` brings it back on the same ports and data dir."""
        _kill(self.popen)

    def start(self) -> None:
        with open(self.log, "ab") as f:
            self.popen = subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        _wait_healthy(self)


def etcd_binary() -> str:
    """Path of the etcd binary. Raises RuntimeError naming the fix when it is missing."""
    path = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if path is None:
        raise RuntimeError(
            "etcd is not installed: run `bash ci/install.sh` (as root it apt-installs the Debian "
            "etcd-server package), or `apt-get install -y etcd-server`"
        )
    return path


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return b'"true"' in r.read()
    except OSError:
        return False


def _start(tmp: Path, extra: tuple = ()) -> Etcd:
    client, peer = _free_ports(2)
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    log = tmp / "etcd.log"
    args = [
        etcd_binary(),
        "--name",
        "kvp",
        "--data-dir",
        str(tmp / "data"),
        "--listen-client-urls",
        url,
        "--advertise-client-urls",
        url,
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
        "--initial-cluster",
        f"kvp={peer_url}",
        "--logger",
        "zap",
        "--log-level",
        "warn",
        *extra,
    ]
    with open(log, "wb") as f:
        popen = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    etcd = Etcd(url, popen, log, args)
    _wait_healthy(etcd)
    return etcd


def _wait_healthy(etcd: Etcd) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if etcd.popen.poll() is not None:
            raise RuntimeError(f"etcd exited with {etcd.popen.returncode}:\n{etcd.log_tail()}")
        if _healthy(etcd.url):
            return
        time.sleep(0.05)
    _kill(etcd.popen)
    raise RuntimeError(f"etcd not healthy after {START_TIMEOUT_S} s:\n{etcd.log_tail()}")


def _kill(popen: subprocess.Popen) -> None:
    if popen.poll() is None:
        popen.kill()
    popen.wait(timeout=10)


@contextlib.contextmanager
def etcd_server(attempts: int = 3, extra: tuple = ()):
    """A single-member etcd on free loopback ports (``extra``: more etcd flags). Yields Etcd; kills it and removes
    its data on exit. Retries the start (a freed port can be taken by another process before etcd binds it)."""
    with tempfile.TemporaryDirectory(prefix="kvp-etcd-") as d:
        for i in range(attempts):
            tmp = Path(d) / str(i)
            tmp.mkdir()
            try:
                etcd = _start(tmp, extra)
                break
            except RuntimeError:
                if i == attempts - 1:
                    raise
        try:
            yield etcd
        finally:
            _kill(etcd.popen)
