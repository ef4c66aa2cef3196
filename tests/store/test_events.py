"""KV events of a real master (--events-port 0) with a real store node on loopback (master/events.py): puts,
removes and evictions arrive as vLLM-framed batches that vLLM's own decoder reads; a late subscriber gets the
replay window; a malformed replay request is dropped without disturbing another subscriber; a subscriber without
credentials gets nothing; `kvplugins events` prints the stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest
import zmq
from helpers.cluster import store_cluster

from kvplugins.security import load_secret
from kvplugins.security.curve import client_socket
from kvplugins.store import ClientConfig, StoreClient
from kvplugins.store.master.events import END_SEQ, EventBatch

pytestmark = pytest.mark.timeout(120)
DECODE = msgspec.msgpack.Decoder(EventBatch)


@pytest.fixture(scope="module")
def cluster():
    flags = {"events_port": 0, "events_buffer": 1000, "eviction_grace_ms": 0}  # evictions right after puts
    with store_cluster(nodes=1, segment_size="8MiB", master_flags=flags) as c:
        yield c


@pytest.fixture(scope="module")
def endpoints(cluster):
    with StoreClient(ClientConfig(master=cluster.master)) as c:
        info = c.master_call("info", [])
    assert info["events"].startswith("tcp://") and info["events_replay"].startswith("tcp://")
    return info["events"], info["events_replay"]


def subscribe(ctx, endpoint: str, keys="secret"):
    """A SUB of the event stream; authenticated with this process's secret unless ``keys`` is None."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvplugins")
    client_socket(sub, load_secret() if keys == "secret" else keys)
    sub.connect(endpoint)
    return sub


def dealer(ctx, endpoint: str, keys="secret"):
    """A DEALER of the replay endpoint; authenticated with this process's secret unless ``keys`` is None."""
    s = ctx.socket(zmq.DEALER)
    client_socket(s, load_secret() if keys == "secret" else keys)
    s.connect(endpoint)
    return s


def collect(sub, want: int, timeout_ms: int = 10000) -> list:
    """(seq, event) pairs until ``want`` events arrived."""
    out = []
    while len(out) < want and sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kvplugins" and len(seq) == 8
        out += [(int.from_bytes(seq, "big", signed=True), ev) for ev in DECODE.decode(payload).events]
    return out


def test_puts_removes_and_evictions_are_published(cluster, endpoints):
    ctx = zmq.Context()
    sub = subscribe(ctx, endpoints[0])
    with StoreClient(ClientConfig(master=cluster.master)) as c:
        while not c.batch_exists(["probe"])[0]:  # a PUB drops what is sent before the SUB joined
            c.put("probe", b"x")
            collect(sub, 1, 200)
        keys = [f"ev/{i}" for i in range(4)]
        assert not any(c.batch_put(keys, [os.urandom(1000) for _ in keys]))
        got = collect(sub, 4)
        assert [(type(e).__name__, e.block_hashes[0].decode(), e.medium, e.reason) for _, e in got] == [
            ("BlockStored", k, "CPU", "stored") for k in keys
        ]
        assert all(c.batch_exists(keys))  # what the events say, the store holds
        c.remove(keys[0])
        ((_, ev),) = collect(sub, 1)
        assert (type(ev).__name__, ev.block_hashes, ev.reason) == ("BlockRemoved", [keys[0].encode()], "removed")
        big = [f"fill/{i}" for i in range(12)]  # 12 x 1 MiB into an 8 MiB segment: LRU objects evicted
        for k in big:
            c.put(k, os.urandom(1 << 20))
        evicted = {
            e.block_hashes[0].decode()
            for _, e in collect(sub, 40, 3000)
            if type(e).__name__ == "BlockRemoved" and e.reason == "evicted"
        }
        assert evicted and not any(c.batch_exists(sorted(evicted)))
    sub.close(0)
    ctx.term()


def test_vllm_decoder_reads_our_batches(cluster, endpoints):
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    with StoreClient(ClientConfig(master=cluster.master)) as c:  # at least one batch, whatever ran before
        c.put("dec/1", b"abc")
    ctx = zmq.Context()
    replay = dealer(ctx, endpoints[1])
    replay.send_multipart((b"", (0).to_bytes(8, "big", signed=True)))
    assert replay.poll(10000)
    _, topic, seq, payload = replay.recv_multipart()
    batch = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload)  # vLLM's own decoder
    assert batch.events and isinstance(batch.events[0], (kv_events.BlockStored, kv_events.BlockRemoved))
    replay.close(0)
    ctx.term()


def test_late_subscriber_gets_the_replay_window_and_bad_requests_are_dropped(cluster, endpoints):
    with StoreClient(ClientConfig(master=cluster.master)) as c:  # two puts before anyone subscribed
        c.put("late/0", b"ab")
        c.put("late/1", b"abc")
    ctx = zmq.Context()
    bad, good = dealer(ctx, endpoints[1]), dealer(ctx, endpoints[1])
    bad.send_multipart((b"", b"not a sequence number", b"extra"))
    good.send_multipart((b"", (0).to_bytes(8, "big", signed=True)))
    seqs, keys = [], set()
    while good.poll(10000):
        _, topic, seq, payload = good.recv_multipart()
        if seq == END_SEQ:
            break
        seqs.append(int.from_bytes(seq, "big", signed=True))
        keys |= {e.block_hashes[0].decode() for e in DECODE.decode(payload).events}
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] == 0  # every batch, in order
    assert {"late/0", "late/1"} <= keys
    assert not bad.poll(300)  # the malformed request got no answer...
    with StoreClient(ClientConfig(master=cluster.master)) as c:
        assert c.get("late/1") == b"abc"  # ...and the master serves on
    bad.close(0), good.close(0)
    ctx.term()


def test_cli_prints_the_replayed_stream(cluster, endpoints):
    with StoreClient(ClientConfig(master=cluster.master)) as c:  # three events, whatever ran before
        for i in range(3):
            c.put(f"cli/{i}", b"abc")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvplugins.cli",
            "events",
            "--master",
            cluster.master,
            "--replay-from",
            "0",
            "--count",
            "3",
            "--timeout-s",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **cluster.env},
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert len(lines) == 3 and lines[0]["seq"] == 0 and lines[0]["type"] in ("BlockStored", "BlockRemoved")
    assert {"key", "medium", "reason", "ts"} <= set(lines[0])


def test_a_subscriber_without_credentials_gets_nothing(cluster, endpoints):
    """The PUB and the replay ROUTER are CURVE servers (master/events.py): a plain SUB or DEALER, or one with the
    wrong server key, never completes the handshake, so no key name reaches it, while an authenticated
    subscriber beside it gets the same events."""
    ctx = zmq.Context()
    plain, good = subscribe(ctx, endpoints[0], keys=None), subscribe(ctx, endpoints[0])
    replay = dealer(ctx, endpoints[1], keys=None)
    replay.send_multipart((b"", (0).to_bytes(8, "big", signed=True)))
    with StoreClient(ClientConfig(master=cluster.master)) as c:
        got = []
        for i in range(50):  # until the authenticated SUB has joined
            c.put(f"secret/{i}", b"x")
            got += collect(good, 1, 200)
            if got:
                break
        assert got and got[0][1].block_hashes[0].startswith(b"secret/")
    assert not plain.poll(500) and not replay.poll(500)
    for s in (plain, good, replay):
        s.close(0)
    ctx.term()
