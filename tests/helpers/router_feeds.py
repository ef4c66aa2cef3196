"""The router's KV event feeds against an engine's own publisher class (tests/vllm/test_router_feeds.py: vLLM's;
tests/sglang/test_router_feeds_sglang.py: SGLang's): an Engine wraps the class, ``scenario`` is the check both
engines pass."""

from __future__ import annotations

import errno
import os
import socket
import time

import pytest
import zmq

from kvplugins.router.config import RouterConfig
from kvplugins.router.feeds import Feeds
from kvplugins.router.fleet import Fleet, block_ids

BT = 16
TOKENS = list(range(1000, 1000 + 8 * BT))  # a prompt of 8 full blocks
URLS = "http://127.0.0.1:1,http://127.0.0.1:2"


def until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """One engine's publisher (``ev``: vLLM's or SGLang's kv_events module; its ZmqEventPublisher class) bound on
    ``port`` (default: a free one); ``send`` publishes one batch."""

    def __init__(self, ev, port: int = 0):
        self.kind = "vllm" if ev.__name__.startswith("vllm") else "sglang"
        self.port = port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        bind = f"tcp://*:{self.port}"  # both bind wildcard endpoints and connect the rest
        self.ev = ev
        deadline = time.monotonic() + 10
        while True:  # a port given again: the closed publisher's zmq I/O thread lets it go asynchronously
            try:
                self.pub = ev.ZmqEventPublisher(0, endpoint=bind)
                return
            except zmq.ZMQError as e:
                if not port or e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stored(self, hashes, parent, tokens, medium="GPU"):
        return self.ev.BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=BT,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )

    def send(self, *events) -> None:
        self.pub.publish(self.ev.KVEventBatch(time.time(), list(events)))

    def close(self) -> None:
        self.pub.shutdown()


def hashes(kind: str, n: int) -> list:
    """Engine block hashes as each engine publishes them: vLLM's sha256 bytes, SGLang's signed int64s."""
    if kind == "vllm":
        return [os.urandom(32) for _ in range(n)]
    return [int.from_bytes(os.urandom(8), "big", signed=True) for _ in range(n)]


def joined(fleet: Fleet, engine: Engine, index: int) -> None:
    """Publish empty-cache notices until the router's SUB has joined (a PUB drops what it sends before)."""

    def seen():
        engine.send(engine.ev.AllBlocksCleared())
        return fleet.status()[index]["events"] > 0

    until(seen, "the router to join the publisher")


def predict(fleet: Fleet, exclude=()) -> tuple[int, int, int]:
    """(chosen instance, its local blocks, its pool blocks) for TOKENS; the request finishes at once and leaves
    no routing history (only events count here)."""
    d, t = fleet.choose(len(TOKENS), block_ids(TOKENS, BT), set(exclude))
    assert t is not None
    fleet.done(t)
    fleet.instances[d.index].cache.discard(block_ids(TOKENS, BT)[t.local_blocks :])
    return d.index, t.local_blocks, t.pool_blocks


@pytest.fixture
def feeds():  # re-exported by the test modules
    """Start Feeds over a Fleet for a config; everything is closed after the test."""
    made = []

    def make(**kw):
        cfg = RouterConfig(instances=URLS, block_tokens=BT, prefill_tok_s=1000, **kw)
        fleet = Fleet(cfg)
        f = Feeds(cfg, fleet)
        f.start()
        made.append(f)
        return fleet, f

    yield make
    for f in made:
        f.close()


def scenario(ev, feeds, pool_medium: str) -> None:
    """An engine's own events say what its cache holds (also for prompts that never passed the router) and what
    it evicted; a connector's saves (``pool_medium``) what the shared pool holds, which every instance may load."""
    a, b = Engine(ev), Engine(ev)
    kind = a.kind
    try:
        # a pool block costs 1 ms to load (1 MB at 1 GB/s), computing one 16 ms (16 tokens at 1,000 tokens/s)
        fleet, f = feeds(kv_events=f"{a.endpoint},{b.endpoint}", load_gbps=1.0, block_bytes=1_000_000)
        joined(fleet, a, 0)
        joined(fleet, b, 1)
        h = hashes(kind, 6)
        # instance 1 cached 6 blocks of the prompt (a request sent to it, not through the router), in two events
        b.send(b.stored(h[:4], None, TOKENS[: 4 * BT]), b.stored(h[4:], h[3], TOKENS[4 * BT : 6 * BT]))
        until(lambda: fleet.status()[1]["cached_blocks"] == 6, "instance 1's six blocks")
        assert predict(fleet) == (1, 6, 0)
        b.send(b.ev.BlockRemoved(block_hashes=h[2:], medium="GPU"))  # it evicted blocks 2..5
        until(lambda: fleet.status()[1]["cached_blocks"] == 2, "the eviction")
        assert predict(fleet) == (1, 2, 0)
        # instance 0's connector saved blocks 0..4 to the shared pool
        a.send(a.stored(h[:5], None, TOKENS[: 5 * BT], medium=pool_medium))
        until(lambda: fleet.pool_status()["pool_blocks"] == 5, "the pool's five blocks")
        assert predict(fleet, exclude={fleet.instances[1].url}) == (0, 0, 5)  # any instance may load them
        assert predict(fleet) == (1, 2, 3)  # its own two first, the pool's after them
        # a block whose parent the router never saw cannot be chained: not learned, counted
        b.send(b.stored(hashes(kind, 1), hashes(kind, 1)[0], TOKENS[:BT]))
        until(lambda: fleet.pool_status()["unchained_events"] == 1, "the unchained event")
        assert f.status()["bad_messages"] == 0  # every message of the engine's own class decoded
    finally:
        a.close()
        b.close()
