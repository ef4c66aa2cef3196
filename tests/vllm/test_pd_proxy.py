"""pd-proxy pieces without engines: the prefill request it derives and its option checks."""

from __future__ import annotations

import pytest

from kvplugins.cli.pd_proxy import PDProxyConfig, prefill_body
from kvplugins.errors import ConfigError


def test_prefill_body_asks_one_token_and_keeps_client_params():
    body = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"x": 1},
        "kv_transfer_params": {"kvplugins_mode": "direct"},
    }
    out = prefill_body(body)
    assert out["max_tokens"] == 1 and out["stream"] is False and "stream_options" not in out
    assert out["kv_transfer_params"] == {"kvplugins_mode": "direct", "do_remote_decode": True}
    assert body["max_tokens"] == 64  # the client's request is left as it was (it goes to decode)


def test_bad_upstreams_raise_clearly():
    with pytest.raises(ConfigError, match="--prefill is empty"):
        PDProxyConfig(prefill="", decode="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="use http://HOST:PORT"):
        PDProxyConfig(prefill="127.0.0.1:8100", decode="http://127.0.0.1:1")
