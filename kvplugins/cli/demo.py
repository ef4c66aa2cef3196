"""``kvplugins demo``: two fresh vLLM engines share multi-turn KV through the store (kvplugins/demo/run.py).
Exit status 0 only if engine B got external hits and its greedy tokens equal a run without the connector."""
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
    if not res.ok:
        print("FAILED: " + ("no external hits" if res.same_tokens else "tokens differ from the no-connector run"))
        return 1
    return 0
