"""``kvplugins p2p`` as real processes on one etcd: a checkpoint directory published, fetched by a peer that then
serves it, a peer SIGKILLed mid-pull routed around and gone from the catalog when its lease ends, and a label
that is not a safe path refused before a byte is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvplugins.p2p import P2PConfig, P2PStore
from tests.helpers.etcd import etcd_server

CHUNK = 256 << 10
TTL_S = 2


@pytest.fixture(scope="module")
def etcd():
    with etcd_server() as e:
        yield e


def p2p_args(etcd, prefix: str) -> list[str]:
    return [
        "--etcd",
        etcd.endpoint + prefix,
        "--transports",
        "tcp",
        "--chunk-bytes",
        str(CHUNK),
        "--lease-ttl-s",
        str(TTL_S),
    ]


def cli(*args: str, **kw) -> subprocess.Popen:
    code = "import sys; from kvplugins.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, "p2p", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


def wait_for(proc: subprocess.Popen, word: str, timeout_s: float = 60) -> str:
    """The first stdout line of ``proc`` starting with ``word``; fails with its stderr if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(word):
            return line
        if not line and proc.poll() is not None:
            pytest.fail(f"kvplugins p2p exited {proc.returncode} before {word!r}: {proc.stderr.read()[-2000:]}")
    pytest.fail(f"no {word!r} line within {timeout_s} s")


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


def checkpoint(root: Path) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    files = {
        "model-00001-of-00002.safetensors": rng.integers(0, 256, 3 * CHUNK + 17, dtype=np.uint8).tobytes(),
        "model-00002-of-00002.safetensors": rng.integers(0, 256, 2 * CHUNK, dtype=np.uint8).tobytes(),
        "config.json": b'{"model_type": "llama"}',
        "tokenizer/vocab.txt": b"a\nb\n",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_publish_fetch_serve_and_a_peer_killed_mid_pull(etcd, tmp_path):
    args = p2p_args(etcd, "/cli1")
    files = checkpoint(tmp_path / "ckpt")
    pub = cli("publish", str(tmp_path / "ckpt"), "--name", "llama/step7", *args)
    rep = None
    try:
        assert "4 files" in wait_for(pub, "published llama/step7")
        rep = cli("fetch", "llama/step7", str(tmp_path / "replica"), "--serve", *args)
        assert "from 1 peers" in wait_for(rep, "fetched llama/step7")
        wait_for(rep, "serving")
        for rel, data in files.items():
            assert (tmp_path / "replica" / rel).read_bytes() == data
        assert not (tmp_path / "replica" / ".kvplugins-p2p-partial").exists()

        listed = subprocess.run(
            [*cli_cmd(), "list", "llama/", "--json", *args], capture_output=True, text=True, timeout=60
        )
        [row] = [json.loads(line) for line in listed.stdout.splitlines()]
        assert (row["holders"], row["complete"], row["labels"][0]) == (2, 2, "config.json")

        # A third peer pulls; the replica (preferred over the publisher) is SIGKILLed once the first chunk landed.
        store = P2PStore(P2PConfig(etcd=etcd.endpoint + "/cli1", chunk_bytes=CHUNK, transports="tcp", parallel=2))
        try:
            payload = store.catalog.get("llama/step7")
            bufs = [np.zeros(n, dtype=np.uint8) for n in payload.sizes]

            def kill_replica(done, total):
                if rep.poll() is None:
                    rep.kill()
                    rep.wait(10)

            st = store.get_replica("llama/step7", bufs, kill_replica)
            got = {label: b.tobytes() for label, b in zip(payload.labels, bufs)}
            assert got == files
            assert st.failed >= 1 and payload.owner in st.from_peers
            deadline = time.monotonic() + TTL_S + 5
            while store.list("llama/")[0].holders != 2 and time.monotonic() < deadline:  # the publisher and us
                time.sleep(0.2)
            assert store.list("llama/")[0].holders == 2
        finally:
            store.close()
    finally:
        code, err = stop(pub)
        if rep is not None:
            stop(rep)
    assert code == 0 and "Traceback" not in err


def cli_cmd() -> list[str]:
    return [sys.executable, "-c", "import sys; from kvplugins.cli import main; sys.exit(main(sys.argv[1:]))", "p2p"]


def test_a_label_that_is_not_a_safe_path_is_refused_before_writing(etcd, tmp_path):
    store = P2PStore(P2PConfig(etcd=etcd.endpoint + "/cli2", chunk_bytes=CHUNK, transports="tcp"))
    try:
        store.register("evil", [np.ones(100, dtype=np.uint8)], labels=["../outside.bin"])
        out = subprocess.run(
            [*cli_cmd(), "fetch", "evil", str(tmp_path / "in"), *p2p_args(etcd, "/cli2")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        store.close()
    assert out.returncode == 2 and "not a plain relative path" in out.stderr
    assert not (tmp_path / "outside.bin").exists() and not any(Path(tmp_path).rglob("*.bin"))
    assert os.listdir(tmp_path) in ([], ["in"])
