"""Worker processes speaking one JSON object per line, and loopback port helpers. Never blocks without a limit."""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent


class WorkerFailed(RuntimeError):
    """A worker reported an error, died, or did not answer in time. The message names the worker and its log."""


class Worker:
    """A ``python -m storebench.worker`` child. ``call(cmd)`` sends one command and returns its reply dict."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path, timeout_s: float = 120.0):
        self.name, self.timeout_s = name, timeout_s
        self.log_path = log_dir / f"{name}.log"
        env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH_DIR), env.get("PYTHONPATH", "")])))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "storebench.worker", *args],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        self.ready = self._read_reply()

    def call(self, cmd: dict) -> dict:
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise self._failed(f"cannot send {cmd.get('op')!r} ({e})") from e
        return self._read_reply()

    def _read_reply(self) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(self.timeout_s):
                raise self._failed(f"no reply within {self.timeout_s:g} s")
        finally:
            sel.close()
        line = self.proc.stdout.readline()
        if not line:
            raise self._failed(f"exited (rc={self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise self._failed(reply["error"])
        return reply

    def _failed(self, what: str) -> WorkerFailed:
        tail = self.log_path.read_text(errors="replace")[-1500:] if self.log_path.exists() else ""
        return WorkerFailed(f"worker {self.name}: {what}; log {self.log_path}:\n{tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop(self.proc)


def stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; always reaps."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until ``host:port`` accepts TCP connections; raises WorkerFailed on timeout or if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise WorkerFailed(f"{proc.args[0]} exited (rc={proc.returncode}) before listening on {host}:{port}")
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise WorkerFailed(f"nothing listens on {host}:{port} after {timeout_s:g} s")
