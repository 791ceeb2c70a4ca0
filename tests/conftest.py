"""Fixtures shared by every test: the broker URL, per-module vhosts, free ports.

Tests that cross services run against a real RabbitMQ. The URL comes from
SHARDSERVE_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/); `scripts/test` makes
sure it is reachable before pytest starts. Where `rabbitmqctl` is available, each test
module gets its own vhost, so meshes, schedulers and leftovers of one module never see
another's.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

# Helpers shared by unit and integration tests (tests run with --import-mode=importlib).
sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from shardserve.ops.child_mesh import base_amqp_url, isolated_vhost
from shardserve.process.settings import AMQP_URL_ENV

# Gateways that tests start (children inherit this) serve no gRPC unless a test gives a
# port: the default 8001 would collide between concurrent test runs on one machine.
os.environ.setdefault("SHARDSERVE_GATEWAY_GRPC_PORT", "0")


# Per-test time limits (pytest-timeout), set here by kind rather than written in modules.
# A unit test is pure and done in seconds. An integration test starts processes, and its
# module's mesh starts inside the first test's limit. A heavy one (marked) exports or
# quantizes a model, or generates at length. Generous for CI, which shares two cores.
UNIT_TIMEOUT_S = 60
INTEGRATION_TIMEOUT_S = 600
HEAVY_TIMEOUT_S = 1200
INTEGRATION_DIR = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.timeout(_time_limit_s(item)))


def _time_limit_s(item: pytest.Item) -> int:
    if item.get_closest_marker("heavy") is not None:
        return HEAVY_TIMEOUT_S
    if item.path.is_relative_to(INTEGRATION_DIR):
        return INTEGRATION_TIMEOUT_S
    return UNIT_TIMEOUT_S


def _broker_reachable(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), 2) as s:
            s.sendall(b"AMQP\x00\x00\x09\x01")
            return len(s.recv(8)) > 0
    except OSError:
        return False


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """The broker every integration test uses; fails loudly when it is not reachable."""
    url = base_amqp_url()
    if not _broker_reachable(url):
        pytest.fail(
            f"RabbitMQ is not reachable at {url}; run scripts/ensure-rabbitmq or set {AMQP_URL_ENV}"
        )
    return url


@pytest.fixture(scope="module")
def isolated_amqp_url(amqp_url: str) -> Iterator[str]:
    """A fresh vhost for one test module (or the shared URL where vhosts cannot be made)."""
    with isolated_vhost(amqp_url, "shardserve-test") as url:
        yield url
