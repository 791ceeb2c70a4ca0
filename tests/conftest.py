"""Fixtures shared by every test: the broker URL, per-test vhosts, free ports.

Tests that cross services run against a real RabbitMQ. The URL comes from
SHARDSERVE_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/); `scripts/test` makes
sure it is reachable before pytest starts. Where `rabbitmqctl` is available, each mesh gets
its own vhost, so meshes, schedulers and leftovers of one test never see another's.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

from shardserve.settings import AMQP_URL_ENV, DEFAULT_AMQP_URL


def base_amqp_url() -> str:
    return os.environ.get(AMQP_URL_ENV, DEFAULT_AMQP_URL)


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


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


def _can_make_vhosts(url: str) -> bool:
    host = urlsplit(url).hostname
    return shutil.which("rabbitmqctl") is not None and host in ("127.0.0.1", "localhost")


def with_vhost(url: str, vhost: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))


@pytest.fixture(scope="module")
def isolated_amqp_url(amqp_url: str) -> Iterator[str]:
    """A fresh vhost for one test module (or the shared URL where vhosts cannot be made)."""
    if not _can_make_vhosts(amqp_url):
        yield amqp_url
        return
    vhost = f"shardserve-test-{uuid.uuid4().hex[:10]}"
    user = urlsplit(amqp_url).username or "guest"
    _rabbitmqctl("add_vhost", vhost)
    _rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
    try:
        yield with_vhost(amqp_url, vhost)
    finally:
        _rabbitmqctl("delete_vhost", vhost)
