"""P/D across two hosts (issue #34): a vLLM-CPU prefill server (kv_producer) on host 6 and a decode server
(kv_consumer) on host 7, `kvplugins router --decode` on host 7, the store on hosts 1-5 (three-member etcd, HA masters,
two nodes), 1 % loss on both engine hosts' links and 2 ms added to what the decode host receives (delay.py).
For each handover path (through the store; direct: decode reads prefill's KV blocks through the transfer core,
here over TCP between the hosts) the decode side's tokens equal a single instance's, decode loaded the prompt's
pages (none failed), and the handoff latency (prefill's pd_handoff_seconds) is recorded in docs/reliability.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from helpers.installed import require

from kvplugins.demo.engine import EngineSpec, run_fresh
from tests.cluster.delay import delayed
from tests.cluster.deploy import KVP, Deployment
from tests.cluster.engines import NsServer, ns_http
from tests.cluster.net import Net

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]
PREFILL, DECODE, PROXY_PORT = 6, 7, 8100


def _metrics(net: Net, server: NsServer) -> dict[str, float]:
    out: dict[str, float] = {}
    for ln in ns_http(net, server.host, server.url + "/metrics").splitlines():
        if ln.startswith("vllm:kvplugins_") and not ln.startswith("#"):
            name = ln.split("{")[0].split()[0]
            out[name] = out.get(name, 0.0) + float(ln.split()[-1])
    return out


def _delta(after: dict, before: dict, name: str) -> float:
    return after.get(f"vllm:kvplugins_{name}", 0.0) - before.get(f"vllm:kvplugins_{name}", 0.0)


def _extra(d: Deployment, host: int) -> dict:
    ip = d.net.ip(host)
    return {"store": {"master": d.master, "host": ip}, "pd_host": ip, "pd_wait_ms": 30000}


def test_pd_across_two_hosts_over_a_lossy_link_gives_the_single_instance_tokens(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    require("vllm", "bash ci/install.sh")
    from kvplugins.demo.model import ensure_model
    from kvplugins.demo.run import DemoConfig, prompts

    model = str(ensure_model())
    turns = prompts(DemoConfig(conversations=2))[1]
    base = run_fresh(EngineSpec(model, turns))
    handoffs = {}
    with Net(7) as net:
        d = Deployment(net, tmp_path, run="pd", seed=34, segment_mib=256, spare=2)
        servers, proxy = [], None
        try:
            d.start(clients=False)
            producer = {"kv_connector": "KVPluginsConnector", "kv_role": "kv_producer"}
            consumer = {"kv_connector": "KVPluginsConnector", "kv_role": "kv_consumer"}
            consumer["kv_load_failure_policy"] = "recompute"
            prefill = NsServer(net, PREFILL, model, {**producer, "kv_connector_extra_config": _extra(d, PREFILL)},
                               d.env, tmp_path / "prefill.log")  # fmt: skip
            decode = NsServer(net, DECODE, model, {**consumer, "kv_connector_extra_config": _extra(d, DECODE)},
                              d.env, tmp_path / "decode.log")  # fmt: skip
            servers = [prefill, decode]
            for s in servers:
                s.wait_ready()
            port_file = tmp_path / "proxy.port"
            proxy = subprocess.Popen(net.command(DECODE, [*KVP, "router", "--instances", prefill.url, "--decode",
                                     decode.url, "--host", net.ip(DECODE), "--port", str(PROXY_PORT),
                                     "--port-file", str(port_file)]), env=d.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            deadline = time.monotonic() + 60
            while not port_file.exists():
                assert proxy.poll() is None and time.monotonic() < deadline, "the router did not start"
                time.sleep(0.2)
            url = f"http://{net.ip(DECODE)}:{PROXY_PORT}/v1/completions"
            net.shape(PREFILL, loss=1)
            net.shape(DECODE, loss=1)
            with delayed(net.ns(DECODE), "eth0", 2.0, direction="ingress"):
                for index, mode in enumerate(("store", "direct")):
                    before, held = _metrics(net, decode), _metrics(net, prefill)
                    body = {"model": model, "prompt": turns[index], "max_tokens": 16, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True,
                            "kv_transfer_params": {"kvplugins_mode": mode}}  # fmt: skip
                    t0 = time.monotonic()
                    out = ns_http(net, DECODE, url, body)
                    took = time.monotonic() - t0
                    assert out["choices"][0]["token_ids"] == base["tokens"][index], mode
                    time.sleep(1.5)  # the last steps' stats reach /metrics
                    after, held_after = _metrics(net, decode), _metrics(net, prefill)
                    loaded, failed = (
                        _delta(after, before, "loaded_blocks_total"),
                        _delta(after, before, "failed_blocks_total"),
                    )
                    n = _delta(held_after, held, "pd_handoff_seconds_count")
                    s = _delta(held_after, held, "pd_handoff_seconds_sum")
                    assert loaded > 0 and failed == 0 and n == 1, (mode, loaded, failed, n)
                    handoffs[mode] = (s, took, loaded)
        finally:
            if proxy is not None:
                proxy.kill()
                proxy.wait()
            for s in servers:
                s.stop()
            d.stop()
    print(f"handoff (prefill's request end -> decode's ack or saves landed), request, pages: {handoffs}",
          file=sys.stderr)  # fmt: skip
