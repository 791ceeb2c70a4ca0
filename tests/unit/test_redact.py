"""One URL redactor: broker URLs in logs, errors and reports carry no password."""

from __future__ import annotations

import pytest

from shardserve.amqp.failover import FailoverConnection
from shardserve.process.redact import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("amqp://agent:s3cret@rabbit:5672/", "amqp://agent:***@rabbit:5672/"),
        ("amqp://rabbit/", "amqp://rabbit/"),
        ("amqp://guest@rabbit/", "amqp://guest@rabbit/"),
        ("amqps://u:p@h:5671/vh?heartbeat=5", "amqps://u:***@h:5671/vh?heartbeat=5"),
        ("amqp://u:p@ss@[::1]:5672/", "amqp://u:***@[::1]:5672/"),  # "@" in the password
        ("amqp://:only-password@h/", "amqp://:***@h/"),
        ("amqp://u:p%40x@h/%2F", "amqp://u:***@h/%2F"),
    ],
)
def test_the_password_and_only_it_is_hidden(url: str, shown: str) -> None:
    assert redact_url(url) == shown


async def test_failover_names_brokers_through_it() -> None:
    connection = FailoverConnection(["amqp://u:s3cret@a:5672/", "amqp://v:other@b:5673/"])
    assert connection.current_url == "amqp://u:***@a:5672/"
    connection._advance()
    assert connection.current_url == "amqp://v:***@b:5673/"
