"""P/D direct path without engines: a decode-side read of producer blocks lands only while the producer holds
them (its lease word carries the request's token), and the ack reaches the producer's mailbox. Real transfer
engines on loopback (shared memory for the mailbox); the KV memory is read both ways: with process_vm_readv
(same host, no producer thread involved: vmread.py) and through the transfer core's TCP."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("path", ["vmread", "tcp"])
def test_read_needs_the_lease_and_ack_arrives(path):
    from kvplugins.layout import PageLayout
    from kvplugins.vllm_kv_connector.config import VllmConnectorConfig
    from kvplugins.vllm_kv_connector.pd import Export, Reader, handshake_dict
    cfg = VllmConnectorConfig.from_extra_config({"master": "unused:1", "pd_wait_ms": 50})
    prod = np.random.default_rng(0).integers(0, 255, size=(8, 4096), dtype=np.uint8)
    dec = np.zeros_like(prod)
    export, reader = Export(PageLayout.from_tensors([prod]), cfg), Reader(PageLayout.from_tensors([dec]), cfg)
    reader._vm_ok = path == "vmread"
    try:
        src = json.loads(json.dumps(handshake_dict(export.handshake)))  # as it travels in kv_transfer_params
        assert reader.read(src, [1, 2], [5, 6], slot=3, token=777) == [1, 2]  # not held: every page fails
        export.lease(3, 777)
        assert reader.read(src, [1, 2], [5, 6], slot=3, token=777) == []
        assert (dec[1] == prod[5]).all() and (dec[2] == prod[6]).all() and not dec[0].any()
        tcp_bytes = reader.engine.stats().get("tcp", {}).get("bytes", 0)
        assert (tcp_bytes == 0) if path == "vmread" else (tcp_bytes >= 2 * 4096)
        assert not export.acked(3, 777)
        reader.ack(src, 3, 777)
        assert export.acked(3, 777)
        export.lease(3, 0)  # released (e.g. after pd_hold_ms): a late read fails instead of reading reused blocks
        assert reader.read(src, [1], [5], slot=3, token=777) == [1]
    finally:
        export.close()
        reader.close()
