"""The connector's KV event bookkeeping (events.py) without an engine: vLLM merges TP workers' event objects the
way KVOutputAggregator does (first worker's object, add_events + increment_workers per other worker); a page is
announced only once every worker reported it, and only once."""

from __future__ import annotations

from helpers.installed import require

require("vllm", "bash ci/install.sh")


def test_a_page_is_announced_once_every_tp_worker_stored_it():
    from kvplugins.vllm_kv_connector.events import EventLog

    w0, w1 = EventLog(32), EventLog(32)
    w0.stored([1, 2], [None, 1], [[0] * 32, [1] * 32])
    w1.stored([1], [None], [[0] * 32])  # rank 1 has not saved page 2 yet
    merged = w0.take()
    merged.add_events(w1.take().get_all_events())
    merged.increment_workers(1)
    assert [e.block_hashes for e in merged.take_complete()] == [[1]]
    assert w0.take() is None  # taken: nothing twice
    w1.stored([2], [1], [[1] * 32])  # rank 1 catches up a step later
    later = w1.take()
    merged.add_events(later.get_all_events())
    (event,) = merged.take_complete()
    assert event.block_hashes == [2] and event.parent_block_hash == 1 and event.medium == "CPU"
    assert merged.take_complete() == []
