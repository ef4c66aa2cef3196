"""What the scheduler half ships to the worker half each step, and what each worker tells it once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata


@dataclass
class WorkerHandshake(KVConnectorHandshakeMetadata):
    """What each worker tells the scheduler half once its KV cache is registered (vLLM collects it from every
    worker, keyed by (PP rank, TP rank)): ``spaces``, the KeySpace fields of each of its Groups (Group.uid order:
    a PP stage's hold its own layers, a replicated group's are the same on every TP rank), and ``pd``, a P/D
    producer's PDHandshake (None elsewhere)."""

    spaces: list = field(default_factory=list)
    pd: Any = None


@dataclass
class PageBatch:
    """Pages to move: page ``hashes[i]`` (vLLM block hash bytes) <-> engine block ``block_ids[i]`` of KV cache
    group ``groups[i]`` (a hybrid model's groups are keyed apart; a block id is one group's at a time). Saves
    carry, when vLLM publishes KV events, each page's ``token_ids`` and ``parents`` (the previous page's hash,
    None for a prompt's first page), for the BlockStored events of the pages that land."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    parents: list[bytes | None] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)  # KV cache group of each page (0 for one-group models)

    def add(self, block_ids, hashes, token_ids=(), parents=(), group: int = 0) -> None:
        self.block_ids.extend(block_ids)
        self.hashes.extend(hashes)
        self.token_ids.extend(token_ids)
        self.parents.extend(parents)
        self.groups.extend([group] * len(block_ids))

    def extend(self, other: "PageBatch") -> None:
        """Append ``other``'s pages (with their groups, tokens and parents)."""
        for mine, theirs in (
            (self.block_ids, other.block_ids),
            (self.hashes, other.hashes),
            (self.token_ids, other.token_ids),
            (self.parents, other.parents),
            (self.groups, other.groups),
        ):
            mine.extend(theirs)

    def by_group(self) -> dict[int, "PageBatch"]:
        """This batch split per KV cache group (token ids and parents stay with the pages that carry them); a
        one-group batch is returned as it is."""
        if len(set(self.groups)) <= 1:
            return {self.groups[0]: self} if self.groups else {}
        out: dict[int, PageBatch] = {}
        for g in dict.fromkeys(self.groups):
            idx = [i for i, x in enumerate(self.groups) if x == g]
            out[g] = PageBatch(
                [self.block_ids[i] for i in idx],
                [self.hashes[i] for i in idx],
                [self.token_ids[i] for i in idx] if self.token_ids else [],
                [self.parents[i] for i in idx] if self.parents else [],
                [g] * len(idx),
            )
        return out

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
    before it): their in-flight saves must land before this step's forward. fence_all: every in-flight save
    must (a sliding-window group frees a running request's blocks that left its window).
    idle: no token is scheduled this step (vLLM keeps stepping while requests wait for the connector).
    waiting: some request waits for a P/D producer's pages to land in the store (the scheduler looks again
    next step).
    early: the worker may start ``async_loads`` and ``acks`` and mark ``held`` before this step's forward
    (in ``handle_preemptions``): vLLM zeroes or copies none of their blocks in this step.
    """

    loads: PageBatch = field(default_factory=PageBatch)
    async_loads: dict[str, PageBatch] = field(default_factory=dict)
    saves: dict[str, PageBatch] = field(default_factory=dict)
    fence: set[str] = field(default_factory=set)
    fence_all: bool = False
    early: bool = False
    idle: bool = False
    waiting: bool = False
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
    finished_at: float = 0.0  # time.monotonic() when vLLM finished the request (system-wide clock)


@dataclass
class RemoteLoad:
    """P/D consumer, direct path: the async load of request ``req_id`` reads ``remote_ids`` (producer blocks,
    in page order) from producer rank ``src`` (PDHandshake fields), then acks ``token`` into mailbox ``slot``."""

    src: dict
    remote_ids: list[int]
    slot: int
    token: int
