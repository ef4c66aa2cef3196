"""``kvplugins pd-proxy``: an OpenAI-compatible proxy for vLLM prefill/decode disaggregation.

Each ``POST /v1/completions`` or ``/v1/chat/completions`` goes first to a prefill instance (``kv_role:
kv_producer``) with ``max_tokens=1``, no streaming and ``kv_transfer_params={"do_remote_decode": true}`` (plus any the client gave, e.g. ``"kvplugins_mode":
"direct"``); the
``kv_transfer_params`` of its answer are added to the original request, which goes to a decode instance
(``kv_consumer``) whose answer (streamed or not) is relayed as is. Instances are used round-robin. Other
paths (``GET /v1/models``, ``/health``, ``/metrics``) go to a decode instance. Standard library only (runs
where vLLM is not installed). The listening port is printed (and written to ``--port-file``).
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kvplugins.config import add_arguments, component, from_args
from kvplugins.errors import ConfigError

GENERATE = ("/v1/completions", "/v1/chat/completions")


@component("pd_proxy")
@dataclass(frozen=True)
class PDProxyConfig:
    """``kvplugins pd-proxy`` options. URLs: http://host:port of vLLM OpenAI servers."""

    prefill: str = field(default="", metadata={"help": "comma list of prefill (kv_producer) base URLs"})
    decode: str = field(default="", metadata={"help": "comma list of decode (kv_consumer) base URLs"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=0, metadata={"help": "port to listen on; 0 = a free port (printed)"})
    port_file: str = field(default="", metadata={"help": "write the listening port here once serving"})
    timeout_s: float = field(default=600.0, metadata={"help": "limit of each upstream request (s)"})

    def __post_init__(self):
        for name in ("prefill", "decode"):
            urls = _urls(getattr(self, name))
            if not urls:
                raise ConfigError(
                    f"pd-proxy --{name} is empty: give the base URL(s) of the {name} instance(s), "
                    "e.g. http://127.0.0.1:8100"
                )
            bad = [u for u in urls if urllib.parse.urlsplit(u).scheme != "http" or not urllib.parse.urlsplit(u).port]
            if bad:
                raise ConfigError(f"pd-proxy --{name} {bad}: use http://HOST:PORT")


def _urls(text: str) -> list[str]:
    return [u.strip().rstrip("/") for u in text.split(",") if u.strip()]


class _Upstreams:
    def __init__(self, cfg: PDProxyConfig):
        self._p, self._d = itertools.cycle(_urls(cfg.prefill)), itertools.cycle(_urls(cfg.decode))
        self._lock = threading.Lock()
        self.timeout_s = cfg.timeout_s

    def pick(self) -> tuple[str, str]:
        with self._lock:
            return next(self._p), next(self._d)

    def open(self, base: str, method: str, path: str, body: bytes | None, headers: dict):
        """Send a request upstream; returns the http.client response (the caller reads it)."""
        u = urllib.parse.urlsplit(base)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=self.timeout_s)
        conn.request(method, path, body=body, headers=headers)
        return conn.getresponse()


def prefill_body(body: dict) -> dict:
    """The prefill request: one token, no streaming, asking the producer to hand the KV over."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    asked = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else {}
    out.update(max_tokens=1, stream=False, kv_transfer_params={**asked, "do_remote_decode": True})
    return out


def make_handler(up: _Upstreams):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: one line per request is noise at load
            return

        def _relay(self, resp) -> None:
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := resp.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def _error(self, status: int, msg: str) -> None:
            data = json.dumps({"error": {"message": msg, "type": "pd_proxy_error"}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            try:
                self._relay(up.open(up.pick()[1], "GET", self.path, None, {}))
            except OSError as e:
                self._error(502, f"decode instance unreachable: {e}")

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            hdrs = {"Content-Type": "application/json"}
            if self.headers.get("Authorization"):
                hdrs["Authorization"] = self.headers["Authorization"]
            prefill, decode = up.pick()
            try:
                if self.path.split("?")[0] not in GENERATE:
                    return self._relay(up.open(decode, "POST", self.path, raw, hdrs))
                body = json.loads(raw or b"{}")
                resp = up.open(prefill, "POST", self.path, json.dumps(prefill_body(body)).encode(), hdrs)
                answer = resp.read()
                if resp.status != 200:
                    return self._error(
                        resp.status, f"prefill instance {prefill}: {answer[:500].decode(errors='replace')}"
                    )
                params = json.loads(answer).get("kv_transfer_params")
                body = {**body, "kv_transfer_params": params} if params else body
                self._relay(up.open(decode, "POST", self.path, json.dumps(body).encode(), hdrs))
            except (OSError, ValueError) as e:
                self._error(502, f"P/D request failed: {e!r}")

    return Handler


def add_parser(sub) -> None:
    p = sub.add_parser("pd-proxy", help="OpenAI-compatible proxy: prefill on one vLLM instance, decode on another")
    add_arguments(p, PDProxyConfig)
    p.add_argument("--config", help="TOML/JSON config file ([pd_proxy] table)")


def serve(cfg: PDProxyConfig) -> ThreadingHTTPServer:
    """A started-later server for ``cfg`` (call serve_forever); its port is ``server.server_address[1]``."""
    server = ThreadingHTTPServer((cfg.host, cfg.port), make_handler(_Upstreams(cfg)))
    server.daemon_threads = True
    return server


def run(args) -> int:
    cfg = from_args(PDProxyConfig, args)
    server = serve(cfg)
    port = server.server_address[1]
    print(f"kvplugins pd-proxy: http://{cfg.host}:{port} (prefill {cfg.prefill}; decode {cfg.decode})", flush=True)
    if cfg.port_file:
        Path(cfg.port_file).write_text(str(port))
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
