"""The one precedence order (flag > env > file > default) and loud rejection of bad values."""

import argparse
import dataclasses

import pytest

from kvplugins.config import Bytes, add_arguments, component, format_bytes, from_args, load, parse_bytes
from kvplugins.errors import ConfigError


@component("demo_cfg")
@dataclasses.dataclass(frozen=True)
class Cfg:
    master: str = ""
    segment_size: Bytes = 1 << 30
    timeout_ms: float = 500.0
    replicas: int = 1
    contribute: bool = False


def test_defaults_when_nothing_given():
    assert load(Cfg, environ={}) == Cfg()


def test_precedence_flag_over_env_over_file(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text('[demo_cfg]\nmaster = "file:1"\nreplicas = 3\nsegment_size = "2GiB"\n')
    env = {"KVPLUGINS_DEMO_CFG_MASTER": "env:2", "KVPLUGINS_DEMO_CFG_TIMEOUT_MS": "750"}
    cfg = load(Cfg, {"master": "flag:3", "replicas": None}, file=f, environ=env)
    assert cfg.master == "flag:3"  # flag beats env and file
    assert cfg.timeout_ms == 750.0  # env beats default
    assert cfg.replicas == 3  # file beats default; a None flag means "not given"
    assert cfg.segment_size == 2 << 30


def test_config_file_from_env(tmp_path):
    f = tmp_path / "k.json"
    f.write_text('{"demo_cfg": {"contribute": true}}')
    assert load(Cfg, environ={"KVPLUGINS_CONFIG": str(f)}).contribute is True


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"KVPLUGINS_DEMO_CFG_REPLICAS": "three"}, "KVPLUGINS_DEMO_CFG_REPLICAS"),
        ({"KVPLUGINS_DEMO_CFG_CONTRIBUTE": "maybe"}, "true/false"),
        ({"KVPLUGINS_DEMO_CFG_SEGMENT_SIZE": "4 parsecs"}, "4GiB"),
        ({"KVPLUGINS_DEMO_CFG_MASTR": "x"}, "valid keys: contribute, master"),
    ],
)
def test_bad_env_values_are_rejected_loudly(env, needle):
    with pytest.raises(ConfigError, match=needle):
        load(Cfg, environ=env)


def test_unknown_flag_lists_valid_keys():
    with pytest.raises(ConfigError, match="unknown key\\(s\\) mastr.*valid keys"):
        load(Cfg, {"mastr": "x"}, environ={})


def test_bad_file_names_the_file(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text("[demo_cfg\n")
    with pytest.raises(ConfigError, match="broken.toml"):
        load(Cfg, file=f, environ={})
    with pytest.raises(ConfigError, match="cannot be read"):
        load(Cfg, file=tmp_path / "missing.toml", environ={})


def test_cli_flags_derive_from_dataclass():
    p = argparse.ArgumentParser()
    add_arguments(p, Cfg)
    args = p.parse_args(["--segment-size", "64MiB", "--contribute"])
    cfg = from_args(Cfg, args)
    assert cfg.segment_size == 64 << 20 and cfg.contribute is True and cfg.master == ""
    assert "KVPLUGINS_DEMO_CFG_SEGMENT_SIZE" in p.format_help()


def test_non_frozen_config_is_refused():
    with pytest.raises(TypeError):
        component("x")(dataclasses.dataclass(type("X", (), {"__annotations__": {"a": int}, "a": 1})))


@pytest.mark.parametrize(
    "text, n", [("4096", 4096), ("64KiB", 65536), ("4GiB", 4 << 30), ("1.5GB", 1500000000), (7, 7)]
)
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


def test_format_bytes():
    assert format_bytes(4 << 30) == "4.0 GiB" and format_bytes(12) == "12 B"
