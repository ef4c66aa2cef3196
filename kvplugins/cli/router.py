"""``kvplugins router``: an OpenAI-compatible router in front of vLLM or SGLang instances that sends each request
where its predicted TTFT is lowest (queue, the prefix the instance holds and the pool holds, prefill and pool load
rates; what each holds from the router's history and, with --kv-events / --store-master, the KV events of the
engines and the store; kvplugins/router) and, with
``--slo-ttft-ms``, answers 429 at once what no instance is predicted to serve within it. The listening port is
printed (and written to ``--port-file``). docs/operations.md."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request


def add_parser(sub) -> None:
    from kvplugins.config import add_arguments
    from kvplugins.router.config import RouterConfig

    p = sub.add_parser("router", help="route OpenAI requests over engine instances by predicted TTFT (the Conductor)")
    p.add_argument("--config", default=None, help="config file (TOML/JSON) with a [router] table")
    add_arguments(p, RouterConfig, common=("instances", "host", "port", "slo_ttft_ms", "prefill_tok_s"))


def run(args) -> int:
    from kvplugins.config import from_args
    from kvplugins.router.config import RouterConfig

    cfg = from_args(RouterConfig, args)
    from kvplugins.router.prompt import EngineTokens

    asyncio.run(_serve(cfg, EngineTokens(_tokenizer(cfg))))
    return 0


def _tokenizer(cfg):
    """The engines' tokenizer: --tokenizer, else the model the first answering instance serves."""
    from transformers import AutoTokenizer

    from kvplugins.errors import ConfigError

    name = cfg.tokenizer
    if not name:
        for url in cfg.urls():
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
                    name = json.loads(resp.read())["data"][0]["id"]
                    break
            except (OSError, ValueError, KeyError, IndexError):
                continue
    if not name:
        raise ConfigError("router: no instance answered /v1/models to name the tokenizer; give --tokenizer")
    return AutoTokenizer.from_pretrained(name)


async def _serve(cfg, tokens) -> None:
    from aiohttp import web

    from kvplugins.router.front import Router, app
    from kvplugins.store.process import write_atomic

    runner = web.AppRunner(app(Router(cfg, tokens)), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"kvplugins router on http://{cfg.host}:{port} over {len(cfg.urls())} instances", flush=True)
    if cfg.port_file:
        write_atomic(cfg.port_file, str(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
