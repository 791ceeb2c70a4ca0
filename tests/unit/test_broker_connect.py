"""The first broker connection waits for a broker: back-off schedule, URL rotation, one log
line per attempt (password hidden), the wait's bound and a stop while waiting.

The schedule and the rotation run on aio-pika's own reconnect loop with the transport
faked (``Connection.connect``) and a manual clock (``asyncio.sleep`` records the waits);
the bound and the stop use a real socket on a port where nothing listens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from aio_pika.connection import Connection

from shardserve.amqp.broker import Broker
from shardserve.amqp.failover import JITTER, Backoff, FailoverConnection
from shardserve.errors import UnavailableError
from shardserve.process.settings import BrokerSettings

NOWHERE = "amqp://guest:s3cret@127.0.0.1:1/"  # port 1: connection refused at once
URLS = ["amqp://u:s3cret@127.0.0.1:1/", "amqp://u:s3cret@127.0.0.1:2/"]


# ---------------------------------------------------------------- the schedule, pure


def test_waits_double_from_the_first_up_to_the_cap() -> None:
    backoff = Backoff(first_s=0.5, cap_s=5.0, rng=lambda: 0.0)
    assert [backoff.next_wait() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_jitter_only_stretches_a_wait_and_by_at_most_its_share() -> None:
    longest = Backoff(first_s=0.5, cap_s=5.0, rng=lambda: 0.999999)
    waits = [longest.next_wait() for _ in range(6)]
    bases = [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert all(base < wait < base * (1 + JITTER) for wait, base in zip(waits, bases, strict=True))


def test_a_success_starts_the_schedule_again() -> None:
    backoff = Backoff(first_s=0.5, cap_s=5.0, rng=lambda: 0.0)
    for _ in range(4):
        backoff.next_wait()
    backoff.reset()
    assert backoff.next_wait() == 0.5


def test_a_cap_below_the_first_wait_is_the_first_wait() -> None:
    backoff = Backoff(first_s=3.0, cap_s=1.0, rng=lambda: 0.0)
    assert [backoff.next_wait() for _ in range(3)] == [3.0, 3.0, 3.0]


# ---------------------------------------------------------------- aio-pika's loop, faked transport


FakeConnect = Callable[[Connection, Any], Coroutine[Any, Any, None]]


@pytest.fixture
def manual_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every ``asyncio.sleep`` of the test returns at once; the delays asked are recorded."""
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, result: Any = None) -> Any:
        if delay > 0:
            waits.append(delay)
        await real_sleep(0)
        return result

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return waits


def fake_transport(failures: int, ports: list[int]) -> FakeConnect:
    """A transport that refuses ``failures`` attempts, then connects; records each port."""

    async def connect(self: Connection, *_timeout: Any) -> None:
        ports.append(int(self.url.port or 0))
        if len(ports) <= failures:
            raise ConnectionRefusedError(111, f"Connect call failed to {self.url}")
        self.connected.set()

    return connect


async def test_the_first_connect_retries_with_back_off_across_the_urls(
    manual_clock: list[float], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ports: list[int] = []
    monkeypatch.setattr(Connection, "connect", fake_transport(5, ports))
    connection = FailoverConnection(URLS, reconnect_interval=0.5, max_interval=5.0, fail_fast="0")
    connection.backoff.rng = lambda: 0.0
    with caplog.at_level(logging.INFO):
        await asyncio.wait_for(connection.connect(timeout=1), 5)
    await connection.close()

    assert ports == [1, 2, 1, 2, 1, 2]  # round robin until one answers
    assert manual_clock[:5] == [0.5, 1.0, 2.0, 4.0, 5.0]
    assert connection.attempts == 6 and connection.reconnect_interval == 0.5  # reset
    lines = [r.getMessage() for r in caplog.records if "not reachable" in r.getMessage()]
    assert len(lines) == 5  # one per failed attempt, ours only (aio-pika's is dropped)
    assert not any("Connection attempt to" in r.getMessage() for r in caplog.records)
    assert "amqp://u:***@127.0.0.1:1/" in lines[0] and "(attempt 1)" in lines[0]
    assert "ConnectionRefusedError" in lines[0] and "next attempt in 0.5 s" in lines[0]
    assert "(to amqp://u:***@127.0.0.1:2/)" in lines[0]
    assert not any("s3cret" in r.getMessage() for r in caplog.records)


async def test_fixed_interval_without_a_cap_as_before(
    manual_clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Connection, "connect", fake_transport(3, []))
    connection = FailoverConnection(URLS[:1], reconnect_interval=0.25, fail_fast="0")
    await asyncio.wait_for(connection.connect(), 5)
    await connection.close()
    assert manual_clock[:3] == [0.25, 0.25, 0.25]


# ---------------------------------------------------------------- Broker.connect, real socket


def _settings(**over: Any) -> BrokerSettings:
    return BrokerSettings(urls=(NOWHERE,), reconnect_interval_s=0.05, **over)


async def test_the_wait_gives_up_after_connect_wait_s_naming_the_url() -> None:
    broker = Broker(_settings(reconnect_max_interval_s=0.1, connect_wait_s=0.6), "t")
    started = time.monotonic()
    with pytest.raises(UnavailableError) as caught:
        await broker.connect()
    assert 0.6 <= time.monotonic() - started < 3.0
    message = caught.value.message
    assert "no broker answered within 0.6 s" in message and "127.0.0.1:1" in message
    assert "s3cret" not in message
    assert not broker.healthy and broker.current_url == ""


async def test_without_a_bound_it_waits_until_stopped(caplog: pytest.LogCaptureFixture) -> None:
    broker = Broker(_settings(reconnect_max_interval_s=0.1), "t")
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(1.0, stop.set)
    with caplog.at_level(logging.INFO):
        connected = await asyncio.wait_for(broker.connect_unless_stopped(stop), 10)
    assert connected is False
    attempts = [r for r in caplog.records if "not reachable" in r.getMessage()]
    assert len(attempts) >= 5  # kept trying the whole second (waits of 0.05 -> 0.1 s)
    assert "stopped while waiting for the broker" in caplog.text
    assert broker.current_url == ""  # the half-open connection is gone
    # the abandoned attempt may still be ending in a task of its own: it must end
    leftovers = [t for t in asyncio.all_tasks() if "connection_factory" in repr(t)]
    await asyncio.wait_for(asyncio.gather(*leftovers, return_exceptions=True), 10)


def test_settings_read_the_wait_and_the_cap_from_the_environment() -> None:
    settings = BrokerSettings.from_env(
        {
            "SHARDSERVE_AMQP_CONNECT_WAIT": "30",
            "SHARDSERVE_AMQP_RECONNECT_MAX_INTERVAL": "2.5",
        }
    )
    assert (settings.connect_wait_s, settings.reconnect_max_interval_s) == (30.0, 2.5)
    defaults = BrokerSettings.from_env({})
    assert defaults.connect_wait_s == 0  # wait as long as it takes
    assert (defaults.reconnect_interval_s, defaults.reconnect_max_interval_s) == (0.5, 5.0)
    with pytest.raises(ValueError, match="> 0"):
        BrokerSettings.from_env({"SHARDSERVE_AMQP_RECONNECT_INTERVAL": "0"})
    with pytest.raises(ValueError, match=">= 0"):
        BrokerSettings.from_env({"SHARDSERVE_AMQP_CONNECT_WAIT": "-1"})
