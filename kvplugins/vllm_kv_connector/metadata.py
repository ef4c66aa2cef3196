"""What the scheduler half ships to the worker half each step."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class PageBatch:
    """Pages to move: page ``hashes[i]`` (vLLM block hash bytes) <-> engine block ``block_ids[i]``. Saves
    carry, when vLLM publishes KV events, each page's ``token_ids`` and ``parents`` (the previous page's hash,
    None for a prompt's first page), for the BlockStored events of the pages that land."""
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    parents: list[bytes | None] = field(default_factory=list)

    def add(self, block_ids, hashes, token_ids=(), parents=()) -> None:
        self.block_ids.extend(block_ids)
        self.hashes.extend(hashes)
        self.token_ids.extend(token_ids)
        self.parents.extend(parents)

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class KVPluginsConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker.

    loads: pages to scatter into blocks before this step's forward (small hits, synchronous).
    async_loads: request id -> pages to load in the background; the request waits in vLLM's
    WAITING_FOR_REMOTE_KVS until the worker reports it in ``finished_recving``; ``remote`` names, for the
    P/D direct path, where such a load reads from. acks: direct-path producers to release with no read.
    held: P/D producer requests whose blocks vLLM holds for this connector (see ``Held``).
    saves: request id -> full pages to store after the forward, in the background.
    fence: requests whose blocks may be freed and rewritten from this step on (finished or preempted
    before it): their in-flight saves must land before this step's forward.
    """
    loads: PageBatch = field(default_factory=PageBatch)
    async_loads: dict[str, PageBatch] = field(default_factory=dict)
    saves: dict[str, PageBatch] = field(default_factory=dict)
    fence: set[str] = field(default_factory=set)
    held: dict[str, "Held"] = field(default_factory=dict)
    remote: dict[str, "RemoteLoad"] = field(default_factory=dict)
    acks: list["RemoteLoad"] = field(default_factory=list)


@dataclass
class Held:
    """P/D producer: a finished request whose blocks vLLM holds until the worker reports it sent.
    mode "store": once its saves landed; "direct": once mailbox word ``slot`` holds ``token``, or ``hold_s``
    seconds after the worker first saw it."""
    mode: str
    slot: int = 0
    token: int = 0
    hold_s: float = 30.0


@dataclass
class RemoteLoad:
    """P/D consumer, direct path: the async load of request ``req_id`` reads ``remote_ids`` (producer blocks,
    in page order) from producer rank ``src`` (PDHandshake fields), then acks ``token`` into mailbox ``slot``."""
    src: dict
    remote_ids: list[int]
    slot: int
    token: int
