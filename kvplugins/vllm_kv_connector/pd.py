"""P/D disaggregation: a prefill instance (``kv_role: kv_producer``) hands a request's KV to a decode instance
(``kv_consumer``), through the store or directly. The direct path's protocol (mailbox, lease words, the read that
is used only while the producer holds the blocks) is engine-independent: kvplugins/layout/handover.py. This
module only translates it into vLLM's terms.

* Producer: ``request_finished`` returns ``(True, {"kvplugins": params})`` and vLLM holds the request's blocks
  until the worker reports it in ``finished_sending``: for the store path once its page saves landed, for the
  direct path once the decode side acknowledged its read (handover ack) or ``pd_hold_ms`` passed; while it
  holds them, the request's lease word holds its token.
* Consumer: the params come back in the decode request (``SamplingParams.extra_args["kv_transfer_params"]`` or
  the OpenAI ``kv_transfer_params`` field). Store path: look the pages up (waiting up to ``pd_wait_ms`` for the
  producer's saves to land), then load as any hit. Direct path: read the producer's KV blocks straight into
  the allocated blocks (handover.Consumer: cma on one host, else rdma or tcp), then ack.

params (JSON): ``v``, ``mode`` ("store"/"direct"), ``pages`` (full prompt pages computed), ``namespace`` (rank
0's key namespace: both sides must match); direct adds ``block_ids`` (producer blocks of those pages), ``slot``,
``token`` and ``ranks`` (TP rank -> the producer worker's handover Offer, ``Offer.to_wire()``). Source
followed: vLLM 0.32 KVConnectorBase_V1 (request_finished / get_finished / handshake metadata).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from kvplugins.layout.handover import MAILBOX_SLOTS, Consumer, Offer, Producer
from kvplugins.transfer import TransferConfig
from kvplugins.transfer.config import transfer_config

__all__ = [
    "MAILBOX_SLOTS",
    "PARAMS_KEY",
    "PDHandshake",
    "consumer",
    "handshake_dict",
    "offer_of",
    "params_of",
    "producer",
]

PARAMS_KEY = "kvplugins"


@dataclass
class PDHandshake(KVConnectorHandshakeMetadata):
    """A producer worker's handover Offer as vLLM carries it (``Offer.to_wire()`` fields: ``descriptor``,
    ``planes``, ``mailbox``)."""

    descriptor: dict = field(default_factory=dict)
    planes: list = field(default_factory=list)
    mailbox: list = field(default_factory=list)


def params_of(request) -> dict | None:
    """Our part of a request's kv_transfer_params, or None."""
    p = getattr(request, "kv_transfer_params", None) or {}
    ours = p.get(PARAMS_KEY) if isinstance(p, dict) else None
    return ours if isinstance(ours, dict) and ours.get("v") == 1 else None


def _transfer(cfg) -> TransferConfig:
    return transfer_config(
        host=cfg.pd_host, transports=cfg.store.transports, timeout_ms=float(cfg.store.transfer_timeout_ms)
    )


def producer(layout, cfg) -> tuple[Producer, PDHandshake]:
    """A prefill worker's handover Producer for ``layout`` (VllmConnectorConfig ``cfg``) and its handshake."""
    p = Producer(layout, _transfer(cfg))
    return p, PDHandshake(**p.offer.to_wire())


def consumer(layout, cfg) -> Consumer:
    """A decode worker's handover Consumer (waits up to ``pd_wait_ms`` for a producer's lease)."""
    return Consumer(layout, _transfer(cfg), cfg.pd_wait_ms)


def handshake_dict(meta: Any) -> dict:
    """PDHandshake (or its dict) -> plain dict for the params."""
    return asdict(meta) if isinstance(meta, PDHandshake) else dict(meta)


def offer_of(src: object) -> Offer:
    """The handover Offer of a producer rank's entry in the params. Raises ProtocolError."""
    return Offer.from_wire(src)
