"""``kvplugins router``'s HTTP front (aiohttp): OpenAI-compatible, over the Fleet's choice.

``POST /v1/completions`` and ``/v1/chat/completions``: the prompt is tokenized (the engines' tokenizer) and hashed
into blocks; the Conductor picks the instance with the lowest predicted TTFT (fleet.py); the request goes there
unchanged and its answer comes back as the instance sent it (a stream chunk by chunk), with the instance named
in an ``x-kvplugins-instance`` header. P/D (``--decode``): the chosen instance is the prefill one; it computes the
prompt and one token (pd.py), and the request with its ``kv_transfer_params`` goes on to the decode instance with
the fewest requests in flight (named in ``x-kvplugins-decode``), whose answer is relayed. With a TTFT SLO, a request
no instance is predicted to serve within it is answered 429 at once, with Retry-After. An instance that fails
before answering is taken out (until its /health answers) and the request goes to the next best one; an answer
already started is never retried (its tokens went to the client). ``GET /v1/models`` goes to a healthy instance (decode first);
``/health`` answers 200 while one is healthy; ``/metrics`` is Prometheus text; ``/router/status`` the fleet as JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import ClientError, ClientSession, ClientTimeout, web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvplugins.router.blocks import EngineHasher
from kvplugins.router.config import RouterConfig
from kvplugins.router.feeds import Feeds
from kvplugins.router.fleet import Fleet, Instance, Ticket, block_ids
from kvplugins.router.pd import prefill_body
from kvplugins.router.rates import Rates, scrape

log = logging.getLogger("kvplugins.router")
GENERATE = ("/v1/completions", "/v1/chat/completions")
INSTANCE_HEADER = "x-kvplugins-instance"  # on every routed answer: the instance that served it
PREDICTION_HEADER = "x-kvplugins-prediction"  # and the prediction: "ttft_ms=N local_blocks=N pool_blocks=N"
DECODE_HEADER = "x-kvplugins-decode"  # P/D: the decode instance (x-kvplugins-instance is the prefill one)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routed = Counter("kvplugins_router_routed", "requests routed, per instance", ["instance"], registry=r)
        self.rejected = Counter("kvplugins_router_rejected", "requests rejected early (429)", registry=r)
        self.retried = Counter("kvplugins_router_retried", "requests sent on after an instance failed", registry=r)
        self.ttft = Histogram("kvplugins_router_ttft_seconds", "measured TTFT of streamed requests", registry=r)
        buckets = (-10, -2, -1, -0.5, -0.2, -0.1, 0, 0.1, 0.2, 0.5, 1, 2, 10)
        self.error = Histogram(
            "kvplugins_router_ttft_error_seconds", "measured - predicted TTFT, streamed requests", buckets=buckets,
            registry=r,
        )  # fmt: skip


class Router:
    """The app's state: the fleet, the prompt tokenizer, the KV event feeds, one HTTP client session, the
    metrics."""

    def __init__(self, cfg: RouterConfig, tokens: Callable[[dict[str, object]], list[int]]):
        """``tokens(body)``: the prompt's token ids as the engines tokenize it (prompt.EngineTokens)."""
        self.cfg, self.tokens, self.fleet, self.metrics = cfg, tokens, Fleet(cfg), Metrics()
        self.feeds = Feeds(cfg, self.fleet)
        self.rates = Rates()
        self.hasher = EngineHasher(cfg.engine_hash.split(":", 1)[1]) if cfg.engine_hash else None
        self.session: ClientSession | None = None

    # -- the generate path ----------------------------------------------------------------------
    def _blocks(self, body: dict[str, object]) -> tuple[list[int], list[int], list[int] | None]:
        """The prompt's tokens, its block ids and (with --engine-hash, for a request with no extra keys) the
        engines' hashes of its blocks."""
        tokens = self.tokens(body)
        blocks = block_ids(tokens, self.cfg.block_tokens)
        plain = not any(k in body for k in ("cache_salt", "lora_request", "multi_modal_data"))
        hashes = self.hasher.hashes(tokens, self.cfg.block_tokens) if self.hasher and plain else None
        return tokens, blocks, hashes

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return _error(400, f"malformed JSON body: {e}", "invalid_request_error")
        tokens, blocks, hashes = await asyncio.to_thread(self._blocks, body)
        tried: set[str] = set()
        while True:
            decision, ticket = self.fleet.choose(len(tokens), blocks, tried, hashes)
            if ticket is None:
                if math.isinf(decision.predicted_s):
                    return _error(
                        503, f"no healthy instance to serve it (tried {sorted(tried) or 'none'})", "unavailable"
                    )
                self.metrics.rejected.inc()
                wait = max(1, math.ceil(decision.predicted_s - self.cfg.slo_ttft_ms / 1000))
                msg = (
                    f"predicted TTFT {decision.predicted_s * 1000:.0f} ms on the best instance exceeds the SLO of "
                    f"{self.cfg.slo_ttft_ms:.0f} ms; retry later"
                )
                return _error(429, msg, "rejected", {"Retry-After": str(wait)})
            self.metrics.routed.labels(ticket.instance.url).inc()
            try:
                if self.fleet.decoders:
                    return await self._disaggregated(request, body, ticket)
                return await self._relay(request, ticket.instance, raw, ticket, ticket, body.get("stream") is True)
            except _NotAnswered as e:
                tried.add(ticket.instance.url)
                self.fleet.failed(ticket.instance, str(e))
                self.metrics.retried.inc()
                log.warning("instance %s failed before answering (%s); sending the request on", ticket.instance.url, e)

    async def _disaggregated(self, request: web.Request, body: dict[str, object], t: Ticket) -> web.StreamResponse:
        """P/D: the prefill on ``t.instance`` (pd.prefill_body), then the request with the prefill's
        kv_transfer_params on the least busy decode instance; a decode instance that fails before answering is
        taken out and the next one tried (the pages are in the store)."""
        assert self.session is not None
        try:
            async with self.session.post(
                t.instance.url + request.path, json=prefill_body(body), headers=_headers(request)
            ) as resp:
                answer = await resp.read()
        except (ClientError, asyncio.TimeoutError, OSError) as e:
            raise _NotAnswered(repr(e)) from e
        finally:
            self.fleet.done(t)  # the prefill no longer queues others
        if resp.status != 200:
            msg = f"prefill instance {t.instance.url}: {answer[:500].decode(errors='replace')}"
            return _error(resp.status, msg, "prefill_error")
        try:
            params = json.loads(answer).get("kv_transfer_params")
        except (ValueError, AttributeError) as e:
            return _error(502, f"prefill instance {t.instance.url} answered no JSON object: {e}", "prefill_error")
        raw = json.dumps({**body, "kv_transfer_params": params} if params else body).encode()
        tried: set[str] = set()
        while (d := self.fleet.decoder(tried)) is not None:
            try:
                return await self._relay(request, d, raw, t, None, body.get("stream") is True)
            except _NotAnswered as e:
                tried.add(d.url)
                self.fleet.failed(d, str(e))
                self.metrics.retried.inc()
                log.warning("decode instance %s failed before answering (%s); trying another", d.url, e)
            finally:
                self.fleet.release(d)
        return _error(503, f"no healthy decode instance (tried {sorted(tried) or 'none'})", "unavailable")

    async def _relay(
        self, request: web.Request, inst: Instance, raw: bytes, t: Ticket, owed: Ticket | None, streamed: bool
    ) -> web.StreamResponse:
        """Send ``raw`` to ``inst`` and stream its answer back as it comes. ``t``: the request's ticket (its
        prediction, for the headers and the TTFT metrics); ``owed``: the ticket to close (first token, done) here,
        None when the caller closes it; ``streamed``: the answer is a stream, so its first chunk is the first token
        (measured TTFT). Raises _NotAnswered when ``inst`` fails before any answer."""
        assert self.session is not None
        try:
            upstream = await self.session.post(inst.url + request.path, data=raw, headers=_headers(request))
        except (ClientError, asyncio.TimeoutError, OSError) as e:
            if owed is not None:
                self.fleet.done(owed)
            raise _NotAnswered(repr(e)) from e
        prediction = f"ttft_ms={t.predicted_s * 1000:.1f} local_blocks={t.local_blocks} pool_blocks={t.pool_blocks}"
        headers = {INSTANCE_HEADER: t.instance.url, PREDICTION_HEADER: prediction}
        if inst is not t.instance:
            headers[DECODE_HEADER] = inst.url
        out = web.StreamResponse(status=upstream.status, headers=headers)
        out.content_type = upstream.content_type
        try:
            await out.prepare(request)
            first = True
            async for chunk in upstream.content.iter_any():
                if first:
                    first = False
                    if owed is not None:
                        self.fleet.first_token(owed)
                    if streamed:
                        measured = time.monotonic() - t.started
                        self.fleet.observe(t, measured)
                        self.metrics.ttft.observe(measured)
                        self.metrics.error.observe(measured - t.predicted_s)
                await out.write(chunk)
            await out.write_eof()
            return out
        finally:
            upstream.release()
            if owed is not None:
                self.fleet.done(owed)

    # -- the rest ---------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for inst in self.fleet.decoders + self.fleet.instances:
            if not inst.healthy:
                continue
            try:
                async with self.session.get(inst.url + "/v1/models") as resp:
                    return web.Response(status=resp.status, body=await resp.read(), content_type=resp.content_type)
            except (ClientError, asyncio.TimeoutError, OSError) as e:
                self.fleet.failed(inst, repr(e))
        return _error(503, "no healthy instance", "unavailable")

    async def health(self, request: web.Request) -> web.Response:
        ok = any(i.healthy for i in self.fleet.instances) and (
            not self.fleet.decoders or any(d.healthy for d in self.fleet.decoders)
        )
        return web.json_response({"healthy": ok}, status=200 if ok else 503)

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "instances": self.fleet.status(),
                "pool": self.fleet.pool_status(),
                "feeds": self.feeds.status(),
                "rates": self.fleet.rates(),
            }
        )

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    async def watch(self) -> None:
        """Poll every instance's /health each health_ms; one that answers 200 is (back) in, else out. With
        measure_rates, the prefill instances' /metrics too (rates.py)."""
        assert self.session is not None
        while True:
            for inst in self.fleet.instances + self.fleet.decoders:
                await self._probe(inst)
            if self.cfg.measure_rates:
                await self._measure()
            await asyncio.sleep(self.cfg.health_ms / 1000)

    async def _measure(self) -> None:
        assert self.session is not None
        for inst in self.fleet.instances:
            if not inst.healthy:
                continue
            try:
                async with self.session.get(inst.url + "/metrics", timeout=ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        self.rates.add(inst.url, scrape(await resp.text()))
            except (ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError):
                continue  # its /health decides whether it is out
        self.fleet.set_load_rate(self.rates.load_bytes_s())

    async def _probe(self, inst: Instance) -> None:
        assert self.session is not None
        try:
            async with self.session.get(inst.url + "/health", timeout=ClientTimeout(total=2)) as resp:
                self.fleet.health(inst, resp.status == 200, f"/health answered {resp.status}")
        except (ClientError, asyncio.TimeoutError, OSError) as e:
            self.fleet.health(inst, False, repr(e))


class _NotAnswered(Exception):
    """The instance failed before sending any answer: the request may go to another one."""


def _headers(request: web.Request) -> dict[str, str]:
    """What goes upstream with a request: JSON, and the client's Authorization (an engine's --api-key)."""
    out = {"Content-Type": "application/json"}
    if "Authorization" in request.headers:
        out["Authorization"] = request.headers["Authorization"]
    return out


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def app(router: Router) -> web.Application:
    a = web.Application(client_max_size=64 << 20)
    for path in GENERATE:
        a.router.add_post(path, router.generate)
    a.router.add_get("/v1/models", router.models)
    a.router.add_get("/health", router.health)
    a.router.add_get("/metrics", router.prometheus)
    a.router.add_get("/router/status", router.status)

    async def lifecycle(_app: web.Application) -> AsyncIterator[None]:
        router.session = ClientSession(timeout=ClientTimeout(total=router.cfg.timeout_s))
        watcher = asyncio.create_task(router.watch())
        if router.feeds.wanted():
            router.feeds.start()
        yield
        watcher.cancel()
        router.feeds.close()
        await router.session.close()

    a.cleanup_ctx.append(lifecycle)
    return a
