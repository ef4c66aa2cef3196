"""Every CLI error is one line naming the value and the fix, exit status 2, never a traceback (issue #31; clig.dev).

The cases the issue found, as a user types them (real `kvplugins` processes), and a property test: every typed
flag of every subcommand (int, float or byte size, found from the config dataclasses behind the flags) given a
value that is not a number answers one line naming the flag or the value, exit 2, before anything starts. Output
into a closed pipe ends quietly."""

import contextlib
import importlib
import io
import pkgutil
import re
import subprocess
import sys
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplugins
from kvplugins.cli import COMMANDS, build_parser, main
from kvplugins.config import Bytes, env_name

CASES = {
    ("replay", "--synth", "--synth-requests", "0"): "--synth-requests must be",
    ("replay", "--synth", "--synth-rate", "0"): "--synth-rate must be",
    ("master", "--port", "80000"): "port 80000 is outside 0-65535",
    ("status", "--master", "127.0.0.1:99999"): "port in 1-65535",
    ("store", "--segment-size", "-1GiB"): "'-1GiB' is not a valid Bytes",
    ("up", "--segment-size", "-1GiB"): "'-1GiB' is not a valid Bytes",
    ("store", "--no-such-flag"): "unrecognized arguments: --no-such-flag",
    ("router",): "--instances is empty",
    ("router", "--instances", "localhost:8000"): "use http://HOST:PORT",
    ("p2p", "list"): "--etcd etcd://host:port",
    ("replay", "--synth", "--routing", "conductor"): "give --prefill-tok-s",
}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvplugins.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", list(CASES), ids=lambda a: " ".join(a))
def test_the_reported_errors_are_one_line(args):
    proc = _run(*args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert CASES[args] in lines[0] and lines[0].startswith("kvplugins")


@pytest.mark.parametrize("args", [("up", "--help"), ("doctor",), ("replay", "--synth", "--dry-run")])
def test_output_into_a_closed_pipe_ends_quietly(args):
    """The reader left before the command wrote (`| head` done): no BrokenPipeError, no 'Exception ignored'."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvplugins.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 1) and err == ""  # (rich ends a broken console with status 1)


def _config_types() -> dict[str, type]:
    """env var name (KVPLUGINS_<COMPONENT>_<FIELD>) -> the field's type, over every config dataclass."""
    out = {}
    for mod in pkgutil.walk_packages(kvplugins.__path__, "kvplugins."):
        if not mod.name.endswith("config") and not mod.name.endswith(".secret"):
            continue
        module = importlib.import_module(mod.name)
        for cls in vars(module).values():
            if isinstance(cls, type) and "_component" in vars(cls):
                for name, typ in typing.get_type_hints(cls).items():
                    if not name.startswith("_"):
                        out[env_name(cls, name)] = typ
    return out


def _numeric_flags() -> list[tuple[str, str]]:
    """(subcommand, --flag) of every flag whose config field is an int, float or byte size."""
    types, sub = _config_types(), next(a for a in build_parser()._actions if a.dest == "command")
    out = []
    for cmd in COMMANDS:
        for action in sub.choices[cmd]._actions:
            env = re.search(r"env (KVPLUGINS_\w+)\)", action.help or "")
            typ = types.get(env.group(1)) if env else None
            if typ in (int, float, Bytes) and action.option_strings and action.nargs is None:
                out.append((cmd, action.option_strings[0]))
    return out


FLAGS = _numeric_flags()


def _not_a_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return not re.search(r"\d", text)
    return False


@settings(max_examples=300, deadline=None)
@given(
    flag=st.sampled_from(FLAGS),
    value=st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=12).filter(_not_a_number),
)
def test_a_non_number_for_any_typed_flag_is_one_line(flag, value):
    cmd, option = flag
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main([cmd, f"{option}={value}"])
        except SystemExit as e:  # argparse's own errors (Parser.error): exit 2 as well
            code = e.code
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err.getvalue(), (flag, value, err.getvalue())
    assert option.lstrip("-").replace("-", "_") in lines[0] or option in lines[0] or repr(value) in lines[0]


def test_every_command_has_typed_flags_checked():
    assert len(FLAGS) > 100 and {cmd for cmd, _ in FLAGS} >= {"master", "store", "up", "replay", "status"}


def _help(cmd: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([cmd, "--help"])
    return out.getvalue()


def test_help_lists_common_flags_first_and_no_foreign_or_doubled_ones():
    master, up, replay = _help("master"), _help("up"), _help("replay")
    assert master.startswith("usage: kvplugins master [options]\n")
    options = re.findall(r"^  (--[a-z-]+)", master, re.M)
    assert options[0] == "--host" and options.index("--port") < options.index("--max-connections")
    assert "advanced [master] settings" in master
    assert "--drain" not in up and "--segment " not in up and "--segment-size" in up  # store --drain's flags
    assert "--no-no-pool" not in replay and "--as-fast-as-possible" not in replay and "--no-pool" in replay
