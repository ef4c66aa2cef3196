"""``kvplugins demo``: two fresh vLLM engines share multi-turn KV through the store (kvplugins/demo/run.py).
Ends with one summary line (PASS/FAIL); exit status 0 only on PASS: engine B got external hits, its greedy tokens
equal a run without the connector, and its median TTFT is under half of that run's."""

from __future__ import annotations

from kvplugins.config import add_arguments, from_args


def add_parser(sub) -> None:
    from kvplugins.demo.run import DemoConfig

    p = sub.add_parser("demo", help="vLLM engine A saves KV, fresh engine B reuses it; checks identical tokens")
    add_arguments(p, DemoConfig)
    p.add_argument("--config", help="TOML/JSON config file ([demo] table)")


def run(args) -> int:
    from kvplugins.demo.run import DemoConfig, report
    from kvplugins.demo.run import run as run_demo

    res = run_demo(from_args(DemoConfig, args), say=lambda s: print(s, flush=True))
    print(report(res), flush=True)
    print(res.summary(), flush=True)
    return 0 if res.ok else 1
