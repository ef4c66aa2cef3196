"""One server under test in its own process, optionally under a low descriptor limit (issue #11 limit tests).

    with LimitedServer("transfer", nofile=64, config={...}) as s:
        s.info      what the server printed once serving (port, address, descriptor...)
        s.stats()   its connection stats: connections, refused, accept_failures, closed_idle, closed_slow (+ applied)
        s.log()     its stderr so far (warnings: refusals, accept failures)

KIND is ``transfer`` (a TransferEngine over tcp exporting REGION_SIZE seeded bytes; ``config``: TransferConfig
fields), ``promote`` (the disk tier's promote endpoint, kvplugins/store/node/disk/server.py, with a stand-in op
that answers ``[0, key + "!"]`` per key and counts the keys it was given; ``config``: ConnLimits fields plus
``max_batch``) or ``metrics`` (kvplugins/store/metrics.Endpoint with a gauge ``kvplugins_test_value`` = 42;
``config``: ConnLimits fields). The child sets RLIMIT_NOFILE to ``nofile`` (soft and hard) before it serves.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

REGION_SIZE = 4 << 20
SEED = 5


def _serve_transfer(config: dict):
    import numpy as np
    from kvplugins.transfer import TransferConfig, TransferEngine

    eng = TransferEngine(TransferConfig(transports="tcp", **config))
    data = np.frombuffer(np.random.default_rng(SEED).bytes(REGION_SIZE), dtype=np.uint8).copy()
    region = eng.register(data, export=True)
    tcp = next(t for t in eng._transports if t.name == "tcp")
    info = {"descriptor": eng.descriptor().to_wire(), "region": region.region_id, "port": tcp._server.port}
    return info, tcp._server.stats, (eng, data)


def _serve_promote(config: dict):
    from kvplugins.security.limits import ConnLimits
    from kvplugins.store.node.disk.server import OpServer

    applied = [0]

    def promote(keys, opts):
        applied[0] += len(keys)
        return [[0, key + "!"] for key in keys]

    max_batch = config.pop("max_batch", 65536)
    server = OpServer("127.0.0.1", {"promote": promote}, ConnLimits(**config), max_batch)
    return {"address": server.address}, lambda: {**server.stats(), "applied": applied[0]}, server


def _serve_metrics(config: dict):
    from prometheus_client.core import GaugeMetricFamily
    from kvplugins.security.limits import ConnLimits
    from kvplugins.store.metrics import Endpoint

    class Collector:
        def collect(self):
            yield GaugeMetricFamily("kvplugins_test_value", "a fixed test value", value=42)

    endpoint = Endpoint("127.0.0.1", 0, "a test", ConnLimits(**config), "store.metrics_")
    endpoint.registry.register(Collector())
    return {"url": endpoint.url, "port": int(endpoint.url.split(":")[2].split("/")[0])}, endpoint.stats, endpoint


def main(kind: str, nofile: int, config: dict) -> None:
    import logging
    import resource

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    serve = {"transfer": _serve_transfer, "promote": _serve_promote, "metrics": _serve_metrics}[kind]
    info, stats, _keep = serve(config)
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            print(json.dumps(stats()), flush=True)
        elif line.strip() == "exit":
            break


class LimitedServer:
    """The server process (module doc); always use as a context manager."""

    def __init__(self, kind: str, nofile: int = 0, config: dict | None = None, start_timeout_s: float = 30):
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, kind, str(nofile), json.dumps(config or {})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        line = self._line(start_timeout_s)
        if not line:
            self.close()
            raise RuntimeError(f"{kind} server did not start: {self.log()[-2000:]}")
        self.info = json.loads(line)

    def _line(self, timeout_s: float) -> str:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                return ""
        return self.proc.stdout.readline()

    def stats(self) -> dict:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        line = self._line(10)
        assert line, f"server gave no stats: {self.log()[-2000:]}"
        return json.loads(line)

    def wait_stats(self, check, timeout_s: float = 10) -> dict:
        """Poll stats until ``check(stats)`` holds; returns them (the last ones if it never did)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.stats()
            if check(st) or time.monotonic() > deadline:
                return st
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")

    def log_lines(self, part: str) -> list[str]:
        """The server's log lines that contain ``part`` (an assertion's message shows them whole)."""
        return [ln for ln in self.log().splitlines() if part in ln]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
            except OSError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self._err.close()

    def __enter__(self) -> "LimitedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def flood(port: int, n: int, host: str = "127.0.0.1") -> list:
    """Open up to ``n`` connections to ``port`` and keep them (the caller closes them); those the kernel does
    not complete within 0.5 s are skipped."""
    import socket

    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection((host, port), timeout=0.5))
        except OSError:
            pass
    return socks


def closed_within(sock, timeout_s: float, send: bytes = b"", every_s: float = 0.0) -> float | None:
    """Seconds until the server closes ``sock`` (EOF or reset), or None if it is still open after ``timeout_s``.
    With ``send`` and ``every_s``: trickles ``send`` one byte every ``every_s`` seconds meanwhile (slowloris)."""
    import select
    import socket

    t0 = time.monotonic()
    i = 0
    while (left := t0 + timeout_s - time.monotonic()) > 0:
        wait = min(left, every_s) if every_s and i < len(send) else left
        if select.select([sock], [], [], wait)[0]:
            try:
                if sock.recv(65536, socket.MSG_DONTWAIT) == b"":
                    return time.monotonic() - t0
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - t0
            except BlockingIOError:
                pass
            continue
        if every_s and i < len(send):
            try:
                sock.send(send[i : i + 1])
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - t0
            i += 1
    return None


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
