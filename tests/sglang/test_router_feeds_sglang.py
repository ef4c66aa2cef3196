"""The router's KV event feed against SGLang 0.5.23's own publisher (its ZmqEventPublisher class and event
types: signed int64 block hashes; medium EXTERNAL for a shared pool such as ours): what an instance caches and
evicted, and what the pool holds, as with vLLM's (tests/helpers/router_feeds.py has the scenario)."""

from __future__ import annotations

import pytest
from helpers.router_feeds import feeds, scenario

pytestmark = pytest.mark.timeout(120)
__all__ = ["feeds"]  # the fixture


def test_sglangs_own_events_say_what_its_cache_and_the_pool_hold(feeds):
    from sglang.srt.disaggregation import kv_events

    scenario(kv_events, feeds, "EXTERNAL")
