"""Agent command line and environment defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardserve.process.cores import usable_cores
from shardserve_agent.settings import parse_settings

REQUIRED = ["--repository", "/models", "--servable", "matmul", "--rank", "1"]


def test_defaults() -> None:
    s = parse_settings(REQUIRED, environ={})
    assert (s.repository, s.servable, s.rank, s.version) == (Path("/models"), "matmul", 1, None)
    assert (s.threads, s.use_cache, s.cache_dir, s.max_memory_mb) == (
        usable_cores(),  # auto
        True,
        None,
        None,
    )
    assert (s.heartbeat_interval, s.drain_seconds) == (1.0, 10.0)


def test_all_options() -> None:
    s = parse_settings(
        [
            *REQUIRED,
            "--version",
            "3",
            "--threads",
            "2",
            "--cache-dir",
            "/c",
            "--no-cache",
            "--max-memory-mb",
            "2048",
            "--heartbeat-interval",
            "0.5",
            "--drain-seconds",
            "4",
        ],
        environ={"SHARDSERVE_AMQP_URL": "amqp://u:p@h:5672/v"},
    )
    assert (s.version, s.threads, s.cache_dir, s.use_cache) == (3, 2, Path("/c"), False)
    assert (s.max_memory_mb, s.heartbeat_interval, s.drain_seconds) == (2048, 0.5, 4.0)
    assert s.broker.url == "amqp://u:p@h:5672/v"
    assert s.resolved_cache_dir(3) is None


def test_environment_supplies_defaults() -> None:
    env = {
        "SHARDSERVE_AGENT_REPOSITORY": "/r",
        "SHARDSERVE_AGENT_SERVABLE": "mlp",
        "SHARDSERVE_AGENT_RANK": "0",
        "SHARDSERVE_AGENT_THREADS": "4",
        "SHARDSERVE_AGENT_CACHE": "false",
    }
    s = parse_settings([], environ=env)
    assert (s.repository, s.servable, s.rank, s.threads, s.use_cache) == (
        Path("/r"),
        "mlp",
        0,
        4,
        False,
    )
    assert parse_settings(["--rank", "2"], environ=env).rank == 2


def test_default_cache_dir_follows_xdg(tmp_path: Path) -> None:
    s = parse_settings(REQUIRED, environ={})
    folder = s.default_cache_dir(2, environ={"XDG_CACHE_HOME": str(tmp_path)})
    assert folder == tmp_path / "shardserve" / "matmul" / "2" / "rank_1"


def test_threads_auto_is_every_usable_core() -> None:
    assert parse_settings([*REQUIRED, "--threads", "auto"], environ={}).threads == usable_cores()
    auto_env = {"SHARDSERVE_AGENT_THREADS": "auto"}
    assert parse_settings(REQUIRED, environ=auto_env).threads == usable_cores()


@pytest.mark.parametrize(
    "argv",
    [
        ["--servable", "m", "--rank", "0"],  # no repository
        [*REQUIRED, "--threads", "0"],
        ["--repository", "/m", "--servable", "m", "--rank", "-1"],
        [*REQUIRED, "--heartbeat-interval", "0"],
        [*REQUIRED, "--max-memory-mb", "lots"],
    ],
)
def test_usage_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings(argv, environ={})
    assert info.value.code == 2
