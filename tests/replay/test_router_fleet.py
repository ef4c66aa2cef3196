"""The router's Fleet (kvplugins/router/fleet.py) without engines: block ids chain, a continuation goes where its
prefix was routed, the queue of prefill tokens in flight steers new requests away and drains at the first token,
the imbalance bound overrides the cache, a failed instance is skipped until its health returns, and the SLO rejects.
The HTTP front over real vLLM-CPU servers: tests/vllm/test_router_e2e.py."""

from __future__ import annotations

from kvplugins.router.config import RouterConfig
from kvplugins.router.fleet import Fleet, block_ids

URLS = "http://127.0.0.1:1001,http://127.0.0.1:1002"


def fleet(**kw) -> Fleet:
    return Fleet(RouterConfig(instances=URLS, block_tokens=4, prefill_tok_s=100, **kw))


def test_block_ids_chain_on_the_prefix():
    a, b = block_ids(list(range(12)), 4), block_ids([*range(8), 99, 9, 10, 11], 4)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # one token changed: that block and later differ
    assert block_ids([0, 1, 2, 3, 4], 4) == a[:1] and block_ids([5, 1, 2, 3], 4) != a[:1]


def test_a_continuation_goes_where_its_prefix_was_routed_and_the_queue_steers_new_ones():
    f = fleet()
    p1, p2 = list(range(40)), list(range(100, 140))
    d1, t1 = f.choose(40, block_ids(p1, 4), set())
    d2, t2 = f.choose(40, block_ids(p2, 4), set())
    assert t1 and t2 and d1.index != d2.index  # cold prompts spread: the second sees the first's queue
    f.done(t1)
    f.done(t2)
    d3, t3 = f.choose(44, block_ids([*p2, 1, 2, 3, 4], 4), set())
    assert t3 and d3.index == d2.index and d3.predicted_s < 0.1  # 40 of 44 tokens cached there
    assert f.instances[d3.index].owed_tokens == 4
    f.first_token(t3)
    assert f.instances[d3.index].owed_tokens == 0 and f.instances[d3.index].inflight == 1


def test_the_imbalance_bound_overrides_the_cache():
    f = fleet(max_imbalance=1)
    warm = list(range(40))
    _, t = f.choose(40, block_ids(warm, 4), set())
    assert t is not None
    f.first_token(t)  # still in flight (decoding), no prefill owed
    tickets = []
    for _ in range(2):  # the warm instance (nothing to prefill), then the bound: 2 in flight vs 0
        tickets.append(f.choose(40, block_ids(warm, 4), set())[1])
        f.first_token(tickets[-1])
    assert tickets[0].instance is t.instance and tickets[1].instance is not t.instance


def test_a_failed_instance_is_skipped_until_healthy_and_the_slo_rejects():
    f = fleet(slo_ttft_ms=500)
    a, b = f.instances
    f.failed(a, "connection refused")
    d, t = f.choose(10, block_ids(list(range(10)), 4), set())
    assert t is not None and t.instance is b
    f.done(t)
    d, t = f.choose(10, [], {b.url})
    assert t is None and d.predicted_s == float("inf")  # nobody left to try
    f.health(a, True)
    d, t = f.choose(100, [], set())  # 1 s of prefill > 0.5 s
    assert t is None and d.rejected and d.predicted_s == 1.0


def test_pd_the_prefill_request_asks_one_token_and_keeps_the_clients_params():
    from kvplugins.router.pd import prefill_body

    body = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"x": 1},
        "kv_transfer_params": {"kvplugins_mode": "direct"},
    }
    out = prefill_body(body)
    assert out["max_tokens"] == 1 and out["stream"] is False and "stream_options" not in out
    assert out["kv_transfer_params"] == {"kvplugins_mode": "direct", "do_remote_decode": True}
    assert body["max_tokens"] == 64  # the client's request is left as it was (it goes to decode)


def test_pd_decode_goes_to_the_least_busy_healthy_instance():
    f = Fleet(RouterConfig(instances=URLS, decode="http://127.0.0.1:2001,http://127.0.0.1:2002", block_tokens=4,
                           prefill_tok_s=100))  # fmt: skip
    d1 = f.decoder(set())
    d2 = f.decoder(set())
    assert d1 is not None and d2 is not None and d1.url != d2.url  # the busy one is passed over
    f.release(d1)
    assert f.decoder(set()) is d1
    f.failed(d2, "refused")
    assert f.decoder(set()) is d1 and f.decoder({d1.url}) is None  # a failed one is out until its health returns
    assert [i["role"] for i in f.status()] == ["prefill", "prefill", "decode", "decode"]


def test_bad_instance_lists_raise_clearly():
    import pytest

    from kvplugins.errors import ConfigError

    with pytest.raises(ConfigError, match="--instances is empty"):
        RouterConfig(instances="", decode="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="--decode .* use http://HOST:PORT"):
        RouterConfig(instances=URLS, decode="127.0.0.1:8100")
    with pytest.raises(ConfigError, match="--kv-events has 1 endpoints for 2"):
        RouterConfig(instances=URLS, kv_events="tcp://127.0.0.1:5557")


def test_baseline_routings_take_turns_or_follow_the_longest_prefix():
    import pytest

    from kvplugins.errors import ConfigError

    rr = fleet(routing="round_robin")
    warm = list(range(40))
    picks = []
    for _ in range(4):
        d, t = rr.choose(40, block_ids(warm, 4), set())
        picks.append(d.index)
        rr.done(t)
    assert sorted(picks) == [0, 0, 1, 1] and picks[0] != picks[1]  # in turn, whatever the cache holds
    pa = fleet(routing="prefix_aware")
    d0, t0 = pa.choose(40, block_ids(warm, 4), set())
    pa.done(t0)
    assert all(pa.choose(40, block_ids(warm, 4), set())[0].index == d0.index for _ in range(3))  # stays with it
    with pytest.raises(ConfigError, match="needs --routing conductor"):
        fleet(routing="round_robin", slo_ttft_ms=100)
    with pytest.raises(ConfigError, match="not one of"):
        fleet(routing="random")


def page(loaded: float, load_s: float) -> str:
    """A /metrics page with our connector's series (labels as vLLM writes them) among vLLM's."""
    lab = '{engine="0",model_name="m"}'
    return "\n".join([
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        f"vllm:prompt_tokens_total{lab} 123.0",
        f"vllm:kvplugins_loaded_bytes_total{lab} {loaded}",
        f"vllm:kvplugins_load_seconds_sum{lab} {load_s}",
        f"vllm:kvplugins_load_seconds_count{lab} 3.0",
    ])  # fmt: skip


def test_the_measured_load_rate_counts_from_the_first_scrape_and_survives_a_restart():
    from kvplugins.router.rates import Rates, scrape

    r = Rates()
    r.add("a", scrape(page(100 << 20, 10.0)))  # before the router: not counted
    r.add("a", scrape(page(104 << 20, 11.0)))  # 4 MiB in 1 s: not enough seen yet
    assert r.load_bytes_s() is None
    r.add("b", scrape(page(0, 0)))
    r.add("b", scrape(page(8 << 20, 1.0)))
    assert r.load_bytes_s() == (12 << 20) / 2.0
    r.add("a", scrape(page(1 << 20, 1.0)))  # a restarted: its counters began again; what it added stays
    r.add("a", scrape(page(5 << 20, 2.0)))
    assert r.load_bytes_s() == (16 << 20) / 3.0


def test_measured_over_predicted_scales_an_instances_predictions_once_asked():
    from kvplugins.router.fleet import Ticket

    f = fleet(measure_rates=True)
    d, t = f.choose(100, [], set())
    assert d.predicted_s == 1.0 and t is not None  # 100 tokens at 100 tokens/s
    f.done(t)
    f.observe(t, 3.0)  # it took 3 s on its instance
    slow = t.instance.url
    assert f.rates()["measured_over_predicted"][slow] == 3.0
    d2, t2 = f.choose(100, [], set())
    assert f.instances[d2.index].url != slow and d2.predicted_s == 1.0  # the other one is now predicted faster
    f.done(t2)
    assert f.choose(100, [], {f.instances[d2.index].url})[0].predicted_s == 3.0  # the slow one, corrected
    for _ in range(50):  # later requests take what was predicted: its correction decays towards 1
        f.observe(Ticket(t.instance, 0, 1.0), 1.0)
    assert 1.0 <= f.rates()["measured_over_predicted"][slow] < 1.02
    off = fleet()
    _, t3 = off.choose(100, [], set())
    off.observe(t3, 3.0)
    assert off.choose(100, [], set())[0].predicted_s == 1.0  # measured and shown, not applied
    assert off.rates()["measured_over_predicted"][t3.instance.url] == 3.0 and not off.rates()["corrected"]
    off.set_load_rate(2e9)
    assert off.rates()["load_bytes_s"] == 2e9
