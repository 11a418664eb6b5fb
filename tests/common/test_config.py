"""kvgrid.common.config: precedence of the four layers, rejection of unknown keys and bad values."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import pytest

from kvgrid.common.config import (
    ByteSize,
    ConfigError,
    GiB,
    MiB,
    add_config_arguments,
    check_choices,
    config_from_args,
    format_byte_size,
    load_config,
    parse_byte_size,
)


class Peer(msgspec.Struct, frozen=True):
    timeout_s: Annotated[float, msgspec.Meta(gt=0, description="peer RPC timeout in seconds")] = 1.0
    hosts: Annotated[list[str], msgspec.Meta(description="peer agents to try")] = []


class ExampleConfig(msgspec.Struct, frozen=True):
    port: Annotated[int, msgspec.Meta(ge=1, le=65535, description="gRPC listen port")] = 50051
    host: Annotated[str, msgspec.Meta(description="listen address")] = "0.0.0.0"
    l1_size: Annotated[ByteSize, msgspec.Meta(description="pinned L1 pool size")] = 8 * GiB
    verbose: Annotated[bool, msgspec.Meta(description="log every request")] = False
    ratio: Annotated[float, msgspec.Meta(description="score weight of L1 hits")] = 0.5
    tiers: Annotated[list[int], msgspec.Meta(description="tier ids to serve")] = msgspec.field(
        default_factory=lambda: [1, 2]
    )
    limit: Annotated[int | None, msgspec.Meta(description="max chunks, none = unbounded")] = None
    peer: Peer = Peer()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvgrid.yaml"
    path.write_text(text)
    return path


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvgrid-test")
    add_config_arguments(parser, ExampleConfig)
    return parser.parse_args(argv)


def test_defaults_without_any_layer() -> None:
    cfg = load_config(ExampleConfig, env={})
    assert cfg == ExampleConfig()
    assert cfg.l1_size == 8 * 1024**3


def test_each_layer_overrides_the_one_below(tmp_path: Path) -> None:
    # port is set in all three layers, host in file+env, ratio only in the file, tiers only in env.
    path = _write(tmp_path, "port: 1000\nhost: file-host\nratio: 0.25\nverbose: true\n")
    env = {"KVGRID_PORT": "2000", "KVGRID_HOST": "env-host", "KVGRID_TIERS": "3, 4"}
    args = _parse(["--config", str(path), "--port", "3000", "--limit", "7"])
    cfg = config_from_args(ExampleConfig, args, env=env)
    assert cfg.port == 3000  # flag beats env and file
    assert cfg.host == "env-host"  # env beats file
    assert cfg.ratio == 0.25  # file beats default
    assert cfg.verbose is True
    assert cfg.tiers == [3, 4]  # comma-separated env list, converted to ints
    assert cfg.limit == 7
    assert cfg.l1_size == 8 * GiB  # untouched default
    # Without the flag, env wins; without env too, the file wins.
    assert config_from_args(ExampleConfig, _parse(["--config", str(path)]), env=env).port == 2000
    assert config_from_args(ExampleConfig, _parse(["--config", str(path)]), env={}).port == 1000


def test_load_config_overrides_act_like_flags(tmp_path: Path) -> None:
    path = _write(tmp_path, "port: 1000\npeer:\n  timeout_s: 2.0\n  hosts: [a]\n")
    cfg = load_config(
        ExampleConfig,
        file=path,
        env={"KVGRID_PEER__TIMEOUT_S": "3.5"},
        overrides={"port": "4000", "peer.hosts": "x,y"},
    )
    assert cfg.port == 4000
    assert cfg.peer == Peer(timeout_s=3.5, hosts=["x", "y"])  # nested env and override merge per field


def test_env_strings_convert_to_field_types() -> None:
    env = {
        "KVGRID_VERBOSE": "1",
        "KVGRID_RATIO": "0.75",
        "KVGRID_LIMIT": "none",
        "KVGRID_PEER__HOSTS": "p1,p2",
        "KVGRID_UNRELATED_SETTING": "ignored: another service's variable",
    }
    cfg = load_config(ExampleConfig, env=env)
    assert (cfg.verbose, cfg.ratio, cfg.limit, cfg.peer.hosts) == (True, 0.75, None, ["p1", "p2"])
    assert load_config(ExampleConfig, env={"KVGRID_VERBOSE": "false"}).verbose is False


def test_bool_flag_with_and_without_value() -> None:
    assert config_from_args(ExampleConfig, _parse(["--verbose"]), env={}).verbose is True
    assert (
        config_from_args(ExampleConfig, _parse(["--verbose", "0"]), env={"KVGRID_VERBOSE": "1"}).verbose
        is False
    )


def test_config_is_frozen() -> None:
    cfg = load_config(ExampleConfig, env={})
    with pytest.raises(AttributeError):
        cfg.port = 1  # type: ignore[misc]


def test_unknown_yaml_key_names_key_and_valid_fields(tmp_path: Path) -> None:
    path = _write(tmp_path, "port: 1\nportt: 2\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'portt'.*did you mean 'port'") as e:
        load_config(ExampleConfig, file=path, env={})
    assert "valid fields of ExampleConfig: port, host, l1_size" in str(e.value)
    assert str(path) in str(e.value)


def test_unknown_nested_yaml_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "peer:\n  timeout: 2\n")
    with pytest.raises(ConfigError, match=r"'peer.timeout'.*valid fields of Peer: timeout_s, hosts"):
        load_config(ExampleConfig, file=path, env={})


def test_unknown_env_var_that_targets_this_config() -> None:
    with pytest.raises(ConfigError, match=r"KVGRID_PROT.*did you mean KVGRID_PORT\?.*KVGRID_L1_SIZE"):
        load_config(ExampleConfig, env={"KVGRID_PROT": "1"})
    with pytest.raises(ConfigError, match=r"KVGRID_PEER__TIMEOUT: Peer has no field 'timeout'"):
        load_config(ExampleConfig, env={"KVGRID_PEER__TIMEOUT": "1"})


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({"KVGRID_PORT": "abc"}, r"'port' has invalid value 'abc' \(from env KVGRID_PORT\): expected `int`"),
        ({"KVGRID_PORT": "70000"}, r"'port' has invalid value '70000' .*expected `int` <= 65535"),
        ({"KVGRID_VERBOSE": "maybe"}, r"'verbose' has invalid value 'maybe' .*expected `bool`"),
        ({"KVGRID_TIERS": "1,x"}, r"'tiers\[1\]' has invalid value 'x' .*expected `int`"),
        ({"KVGRID_PEER__TIMEOUT_S": "0"}, r"'peer.timeout_s' has invalid value '0' .*expected `float` > 0"),
        ({"KVGRID_L1_SIZE": "lots"}, r"'l1_size' has invalid value 'lots' .*byte size such as 8GiB"),
    ],
)
def test_bad_env_value_names_field_value_and_type(env: dict[str, str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(ExampleConfig, env=env)


def test_bad_value_from_file_and_flag_name_their_source(tmp_path: Path) -> None:
    path = _write(tmp_path, "ratio: high\n")
    with pytest.raises(ConfigError, match=rf"'ratio' has invalid value 'high' \(from config file '{path}'\)"):
        load_config(ExampleConfig, file=path, env={})
    with pytest.raises(
        ConfigError, match=r"'port' has invalid value '-3' \(from flag --port\): expected `int` >= 1"
    ):
        config_from_args(ExampleConfig, _parse(["--port=-3"]), env={})
    assert issubclass(ConfigError, ValueError)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(ExampleConfig, file=tmp_path / "missing.yaml", env={})
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(ExampleConfig, file=_write(tmp_path, "- 1\n- 2\n"), env={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(ExampleConfig, file=_write(tmp_path, "port: [1\n"), env={})
    assert load_config(ExampleConfig, file=_write(tmp_path, ""), env={}) == ExampleConfig()


def test_required_field_error() -> None:
    class Needs(msgspec.Struct, frozen=True):
        model: Annotated[str, msgspec.Meta(description="model name")]

    with pytest.raises(ConfigError, match=r"'model' is required.*KVGRID_MODEL.*--model"):
        load_config(Needs, env={})
    assert load_config(Needs, env={"KVGRID_MODEL": "m"}).model == "m"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1GB", 10**9),
        ("1.5GiB", 3 * 512 * 1024**2),
        ("64Ki", 64 * 1024),
        ("4096", 4096),
        ("2 mb", 2 * 10**6),
        (123, 123),
    ],
)
def test_parse_byte_size(text: str | int, expected: int) -> None:
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", "1.5B", "8 parsecs", "", True, -5])
def test_parse_byte_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="byte size"):
        parse_byte_size(bad)


def test_byte_size_fields_from_every_layer(tmp_path: Path) -> None:
    path = _write(tmp_path, "l1_size: 512MiB\n")
    assert load_config(ExampleConfig, file=path, env={}).l1_size == 512 * MiB
    assert load_config(ExampleConfig, file=path, env={"KVGRID_L1_SIZE": "1GB"}).l1_size == 10**9
    args = _parse(["--config", str(path), "--l1-size", "2GiB"])
    assert config_from_args(ExampleConfig, args, env={"KVGRID_L1_SIZE": "1GB"}).l1_size == 2 * GiB
    assert format_byte_size(8 * GiB) == "8GiB" and format_byte_size(1000) == "1000"


def test_help_shows_description_default_and_env(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _parse(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse line wrapping
    assert "--port INT gRPC listen port (default: 50051; env KVGRID_PORT)" in out
    assert "--l1-size SIZE pinned L1 pool size (default: 8GiB; env KVGRID_L1_SIZE)" in out
    assert (
        "--peer.timeout-s FLOAT peer RPC timeout in seconds (default: 1.0; env KVGRID_PEER__TIMEOUT_S)" in out
    )
    assert "(default: 1,2;" in out and "--config FILE" in out


def test_literal_choices_and_empty_default_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    class Choices(msgspec.Struct, frozen=True):
        policy: Annotated[Literal["lru", "fifo"], msgspec.Meta(description="eviction order")] = "lru"
        address: Annotated[str, msgspec.Meta(description="controller address")] = ""

    parser = argparse.ArgumentParser(prog="kvgrid-test")
    add_config_arguments(parser, Choices)
    parser.print_help()
    out = " ".join(capsys.readouterr().out.split())
    assert "--policy {lru,fifo} eviction order (default: lru; env KVGRID_POLICY)" in out
    assert '(default: ""; env KVGRID_ADDRESS)' in out
    assert load_config(Choices, env={"KVGRID_POLICY": "fifo"}).policy == "fifo"
    with pytest.raises(ConfigError, match=r"'policy' has invalid value 'mru' .*one of 'lru', 'fifo'"):
        load_config(Choices, env={"KVGRID_POLICY": "mru"})


@pytest.mark.parametrize(
    ("config", "field", "bad", "choices"),
    [
        ("agent", "eviction_policy", "random", "'lru', 'fifo'"),
        ("agent", "l1_pin_memory", "sometimes", "'auto', 'on', 'off'"),
        ("agent", "peer_fetch", "maybe", "'auto', 'on', 'off'"),
        ("agent", "log_level", "loud", "'debug', 'info', 'warning', 'error'"),
        ("controller", "index_backend", "sqlite", "'memory', 'redis'"),
    ],
)
def test_service_choice_fields_refuse_other_values_naming_them(
    config: str, field: str, bad: str, choices: str
) -> None:
    from kvgrid.agent.config import AgentConfig
    from kvgrid.controller.config import ControllerConfig

    cls: type[msgspec.Struct] = AgentConfig if config == "agent" else ControllerConfig
    flag = "--" + field.replace("_", "-")
    parser = argparse.ArgumentParser(prog="kvgrid-test")
    add_config_arguments(parser, cls)
    pattern = (
        rf"config field '{field}' has invalid value '{bad}' \(from flag {flag}\): expected one of {choices}"
    )
    with pytest.raises(ConfigError, match=pattern):
        config_from_args(cls, parser.parse_args([flag, bad]), env={})
    with pytest.raises(ConfigError, match=rf"'{field}' has invalid value '{bad}' \(from env KVGRID_"):
        load_config(cls, env={"KVGRID_" + field.upper(): bad})


def test_choices_keep_their_spelling_and_accept_other_letter_cases() -> None:
    from kvgrid.agent.config import AgentConfig

    cfg = load_config(AgentConfig, env={"KVGRID_LOG_LEVEL": "WARNING"}, overrides={"eviction_policy": "FIFO"})
    assert (cfg.log_level, cfg.eviction_policy) == ("warning", "fifo")


def test_check_choices_holds_directly_built_configs_to_the_same_choices() -> None:
    class Choices(msgspec.Struct, frozen=True):
        mode: Literal["auto", "on", "off"] = "auto"
        name: str = "x"

    check_choices(Choices(mode="on", name="anything"))
    with pytest.raises(ValueError, match=r"mode='sometimes': expected auto, on or off"):
        check_choices(Choices(mode="sometimes"))  # type: ignore[arg-type]
