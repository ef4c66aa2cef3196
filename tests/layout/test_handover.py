"""P/D handover without engines (layout/handover.py): a decode-side read of producer blocks lands only while the
producer holds them (its lease word carries the request's token), and the ack reaches the producer's mailbox.
Real transfer engines in one process (the mailbox in shared memory); the KV memory is read both ways the
transfer core offers: cma (process_vm_readv, no producer thread involved) and tcp."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvplugins.errors import ProtocolError
from kvplugins.layout import PageLayout
from kvplugins.layout.handover import Consumer, Offer, Producer
from kvplugins.transfer import TransferConfig


@pytest.mark.parametrize("path", ["cma", "tcp"])
def test_read_needs_the_lease_and_ack_arrives(path):
    transfer = TransferConfig(transports=f"shm,{path}" if path == "cma" else "shm,tcp")
    prod = np.random.default_rng(0).integers(0, 255, size=(8, 4096), dtype=np.uint8)
    dec = np.zeros_like(prod)
    producer = Producer(PageLayout.from_tensors([prod]), transfer)
    consumer = Consumer(PageLayout.from_tensors([dec]), transfer, wait_ms=50)
    try:
        offer = Offer.from_wire(json.loads(json.dumps(producer.offer.to_wire())))  # as it travels in params
        assert consumer.read(offer, [1, 2], [5, 6], slot=3, token=777) == [1, 2]  # not held: every page fails
        producer.lease(3, 777)
        assert consumer.read(offer, [1, 2], [5, 6], slot=3, token=777) == []
        assert (dec[1] == prod[5]).all() and (dec[2] == prod[6]).all() and not dec[0].any()
        stats = consumer.engine.stats()
        assert stats[path]["bytes"] >= 2 * 4096 and stats["fallbacks"] == {}
        assert not producer.acked(3, 777)
        consumer.ack(offer, 3, 777)
        assert producer.acked(3, 777)
        producer.lease(3, 0)  # released (e.g. after pd_hold_ms): a late read fails instead of reading reused blocks
        assert consumer.read(offer, [1], [5], slot=3, token=777) == [1]
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"planes": [[1, 2, 3]]},
        {"planes": [[1, 2, 3, -4]]},
        {"mailbox": [1, 7]},
        {"planes": "x"},
        {"descriptor": {"v": 2}},
    ],
)
def test_a_malformed_offer_is_refused_naming_it(bad):
    prod = np.zeros((2, 4096), dtype=np.uint8)
    producer = Producer(PageLayout.from_tensors([prod]), TransferConfig(transports="shm,tcp"))
    try:
        with pytest.raises(ProtocolError, match="malformed"):
            Offer.from_wire({**producer.offer.to_wire(), **bad})
    finally:
        producer.close()
