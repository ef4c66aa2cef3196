"""The transfer core: one TransferEngine per process moving bytes between registered memory regions of
processes, over shared memory or cross-memory attach (same host), RDMA or TCP (any host). See api.py for the
lifecycle and wire.py for the TCP wire format."""

from kvplugins.transfer.api import Region, RegionInfo, SegmentDescriptor, TransferRequest
from kvplugins.transfer.config import TransferConfig
from kvplugins.transfer.engine import TransferEngine

__all__ = ["Region", "RegionInfo", "SegmentDescriptor", "TransferConfig", "TransferEngine", "TransferRequest"]
