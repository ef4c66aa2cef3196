"""SGLang 0.5.23's Mooncake P/D transfer class (``MooncakeTransferEngine``: what its prefill server writes KV into
decode's memory with) on kvplugins' Transfer Engine API, class level with real host tensors in two processes
(issue #36): SGLang's P/D servers themselves need a GPU. ``kvplugins mooncake enable`` (a throw-away site dir) makes
its ``from mooncake.engine import TransferEngine`` ours; prefill writes 4 pages into decode's registered tensor in
another order and decode's bytes equal them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.te_workers import ask, run, served

pytest.importorskip("sglang.srt.disaggregation", reason="sglang not installed: bash ci/install-sglang.sh")

from kvplugins.mooncake import shim as mooncake_shim  # noqa: E402

WORKER = Path(__file__).with_name("mooncake_te_worker.py")


def test_prefill_writes_pages_into_decode_through_sglangs_mooncake_engine_on_ours(tmp_path):
    mooncake_shim.SHIM.enable(tmp_path, force=True)
    site_dir = str(tmp_path)  # its .pth puts the shim ahead of the real wheel
    env = {**os.environ, "MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp"}
    with served(WORKER, "decode", site_dir, env=env) as ((session, addr), decode):
        (rc, digest, probe), _ = run(WORKER, "prefill", site_dir, session, str(addr), env=env)
        assert rc == 0 and probe == 0
        assert ask(decode, f"check {digest}") is True
