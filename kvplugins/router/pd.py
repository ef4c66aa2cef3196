"""P/D disaggregation in ``kvplugins router --decode``: the prefill request derived from a client's, as vLLM's
disaggregated prefill expects it (vLLM 0.32's toy P/D proxy and NIXL/Mooncake connectors: the producer answers
one token and the ``kv_transfer_params`` the consumer needs; our connector's producer saves the pages to the
store, or holds them for a direct read with ``"kvplugins_mode": "direct"``: docs/vllm.md)."""

from __future__ import annotations


def prefill_body(body: dict[str, object]) -> dict[str, object]:
    """The prefill request: one token, no streaming, asking the producer to hand the KV over (any
    ``kv_transfer_params`` the client gave are kept)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    given = body.get("kv_transfer_params")
    asked = given if isinstance(given, dict) else {}
    out.update(max_tokens=1, stream=False, kv_transfer_params={**asked, "do_remote_decode": True})
    return out
