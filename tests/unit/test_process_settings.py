"""Settings declared once (``shardserve.process.options``) and the broker's settings, read
from the environment: the pure rules, with explicit environments."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from shardserve.process import options
from shardserve.process.options import option, variable
from shardserve.process.settings import (
    DEFAULT_AMQP_URL,
    DEFAULT_MAX_MESSAGE_BYTES,
    BrokerSettings,
    ProcessSettings,
    positive_float,
)

PREFIX = "TEST_"


@dataclass(frozen=True, kw_only=True)
class Example:
    name: str = field(metadata=options.required("--name", help="who"))
    delay_s: float = option("--delay", 2.0, parse=positive_float, to_field=lambda s: s * 2)
    loud: bool = option("--loud", False, kind="switch")
    cached: bool = option("--no-cache", True, kind="off_switch")
    mode: str = option("--mode", "a", choices=("a", "b"))
    ident: str | None = option("--example-id", env="ID")
    fixed: int = 7  # not an option


def parse(argv: list[str], env: dict[str, str]) -> Example:
    parser = options.build_parser(Example, env, prefix=PREFIX, prog="ex", description="d")
    return Example(**options.option_values(Example, parser.parse_args(argv)))


def test_defaults_are_the_declared_ones_through_to_field() -> None:
    parsed = parse(["--name", "n"], {})
    assert parsed == Example(name="n")
    assert (parsed.delay_s, parsed.loud, parsed.cached, parsed.mode) == (4.0, False, True, "a")
    assert (parsed.ident, parsed.fixed) == (None, 7)


def test_the_command_line_sets_every_kind_of_option() -> None:
    argv = ["--name", "n", "--delay", "1.5", "--loud", "--no-cache", "--mode", "b"]
    parsed = parse([*argv, "--example-id", "x"], {})
    assert (parsed.delay_s, parsed.loud, parsed.cached, parsed.mode, parsed.ident) == (
        3.0,
        True,
        False,
        "b",
        "x",
    )


def test_environment_variables_are_named_after_the_flags() -> None:
    env = {
        "TEST_NAME": "from-env",
        "TEST_DELAY": "0.5",
        "TEST_LOUD": "Yes",
        "TEST_CACHE": "off",
        "TEST_MODE": "b",
        "TEST_ID": "i",
    }
    parsed = parse([], env)
    assert parsed == Example(
        name="from-env", delay_s=1.0, loud=True, cached=False, mode="b", ident="i"
    )
    # the command line wins over the environment
    assert parse(["--no-loud", "--delay", "3"], env).loud is False
    assert parse(["--delay", "3"], env).delay_s == 6.0


def test_an_empty_variable_counts_as_unset() -> None:
    parsed = parse(["--name", "n"], {"TEST_DELAY": "", "TEST_CACHE": "", "TEST_MODE": ""})
    assert (parsed.delay_s, parsed.cached, parsed.mode) == (4.0, True, "a")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, "the following arguments are required: --name"),
        (["--name", "n", "--delay", "0"], {}, "argument --delay: must be > 0, got 0.0"),
        (["--name", "n"], {"TEST_DELAY": "soon"}, "argument --delay: invalid positive_float"),
        (["--name", "n", "--mode", "c"], {}, "invalid choice: 'c'"),
        (["--name", "n"], {"TEST_MODE": "c"}, "--mode must be a|b, not 'c'"),
    ],
)
def test_bad_values_are_usage_errors_wherever_they_come_from(
    argv: list[str], env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse(argv, env)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_options_in_declaration_order() -> None:
    parser = options.build_parser(Example, {}, prefix=PREFIX, prog="ex", description="d")
    usage = parser.format_usage()
    flags = ["--name", "--delay", "--loud", "--no-cache", "--mode", "--example-id"]
    positions = [usage.index(flag) for flag in flags]
    assert positions == sorted(positions)
    assert "--loud | --no-loud" in usage
    assert isinstance(parser, argparse.ArgumentParser)


# ---------------------------------------------------------------- BrokerSettings


def test_broker_settings_default_without_environment() -> None:
    assert BrokerSettings.from_env({}) == BrokerSettings()
    assert BrokerSettings().urls == (DEFAULT_AMQP_URL,)
    assert BrokerSettings().max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES


def test_broker_settings_from_environment() -> None:
    settings = BrokerSettings.from_env(
        {
            "SHARDSERVE_AMQP_URL": " amqp://a/ ,, amqp://b/",
            "SHARDSERVE_AMQP_HEARTBEAT": "3",
            "SHARDSERVE_AMQP_RECONNECT_INTERVAL": "0.25",
            "SHARDSERVE_MAX_MESSAGE_BYTES": "65536",
        }
    )
    assert settings.urls == ("amqp://a/", "amqp://b/")
    assert (settings.heartbeat_s, settings.reconnect_interval_s) == (3, 0.25)
    assert settings.max_message_bytes == 65536
    assert BrokerSettings.from_env({"SHARDSERVE_AMQP_URL": " , "}).urls == (DEFAULT_AMQP_URL,)


@pytest.mark.parametrize(
    ("raw", "message"), [("12", "must be at least 1024"), ("8M", "must be an integer, got '8M'")]
)
def test_a_bad_chunk_size_is_refused(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BrokerSettings.from_env({"SHARDSERVE_MAX_MESSAGE_BYTES": raw})


def test_environment_only_settings_ignore_fields_without_a_variable() -> None:
    @dataclass(frozen=True)
    class Mixed:
        read: int = variable("TEST_READ", 1, parse=int)
        kept: int = 2

    assert options.from_environment(Mixed, {"TEST_READ": "5", "TEST_KEPT": "9"}) == Mixed(5, 2)
    assert options.from_environment(Mixed, {"TEST_READ": ""}) == Mixed(1, 2)


def test_process_settings_from_environment() -> None:
    assert ProcessSettings.from_env({}) == ProcessSettings(log_level="INFO", event_loop=None)
    env = {"SHARDSERVE_LOG_LEVEL": "debug", "SHARDSERVE_EVENT_LOOP": "asyncio"}
    assert ProcessSettings.from_env(env) == ProcessSettings("debug", "asyncio")
