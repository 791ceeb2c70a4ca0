"""Leadership renewal against RabbitMQ: the active scheduler acks its token and receives a
fresh one on the same channel, again and again, without ever stepping down (RabbitMQ's
consumer_timeout, 30 min by default, would otherwise close the channel of a token held
unacked that long and depose every leader); a standby on the same queue never gets the
token meanwhile, and still takes over when the active scheduler's connection goes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import pytest

from shardserve.amqp.broker import Broker
from shardserve.process.settings import BrokerSettings
from shardserve_scheduler import leadership
from shardserve_scheduler.leadership import Leadership

pytestmark = pytest.mark.integration

RENEW_EVERY_S = 0.5


@dataclass
class Candidate:
    broker: Broker
    events: list[str] = field(default_factory=list)
    lead: Leadership | None = None

    async def elect(self) -> None:
        self.events.append("elect")

    def depose(self, why: str) -> None:
        self.events.append(f"depose: {why}")

    @property
    def leading(self) -> Leadership:
        assert self.lead is not None
        return self.lead


async def until(what: str, check: Callable[[], bool], within_s: float = 60.0) -> None:
    async def poll() -> None:
        # The leadership exposes counters and flags, not events: poll them (interval only).
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(poll(), within_s)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {within_s:.0f} s") from None


async def candidate(url: str, stack: AsyncExitStack) -> Candidate:
    """A scheduler's leadership on its own connection, run until the test ends."""
    broker = Broker(BrokerSettings(urls=(url,)), f"leader-test-{uuid.uuid4().hex[:6]}")
    await broker.connect()
    stack.push_async_callback(broker.close)
    who = Candidate(broker)
    name = f"s-{uuid.uuid4().hex[:6]}"
    who.lead = Leadership(broker, name, who.elect, who.depose, renew_every=RENEW_EVERY_S)
    await who.lead.start()
    loop = asyncio.create_task(who.lead.run())
    stack.push_async_callback(stop, who.lead, loop)
    return who


async def stop(lead: Leadership, loop: asyncio.Task[None]) -> None:
    lead.closing = True
    lead._wake.set()
    await loop


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as exits:
        yield exits


async def test_the_leader_renews_its_token_and_a_standby_still_takes_over(
    isolated_amqp_url: str, stack: AsyncExitStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leadership, "CHECK_SECONDS", 0.1)
    first = await candidate(isolated_amqp_url, stack)
    await until("the first scheduler leads", lambda: first.leading.active)
    second = await candidate(isolated_amqp_url, stack)
    await until("three renewals", lambda: first.leading.renewals >= 3)
    assert first.events == ["elect"]  # one leadership throughout the renewals
    assert second.events == [] and not second.leading.active
    await first.broker.close()  # its connection goes: the held token is requeued
    await until("the standby takes over", lambda: second.leading.active)
    assert second.events == ["elect"]
