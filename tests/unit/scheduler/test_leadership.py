"""Leadership decisions against a fake broker: step down on a lost connection, take the
token back after a reconnect, publish a token when none exists, give it back on failure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from shardserve.amqp.broker import Broker
from shardserve.errors import UnavailableError
from shardserve.wire import topology
from shardserve_scheduler import leadership
from shardserve_scheduler.leadership import Leadership


@dataclass
class FakeToken:
    channel: object = field(default_factory=object)
    rejected: list[bool] = field(default_factory=list)
    acked: int = 0

    async def reject(self, requeue: bool = False) -> None:
        self.rejected.append(requeue)

    async def ack(self) -> None:
        self.acked += 1


@dataclass
class FakeBroker:
    healthy: bool = True
    waiting: int = 0
    published: list[str] = field(default_factory=list)
    listeners: list[Callable[[bool], None]] = field(default_factory=list)

    async def ready_count(self, queue: str) -> int:
        if not self.healthy:
            raise UnavailableError("message broker is unreachable")
        return self.waiting

    async def publish(self, exchange: str, key: str, message: Any, **_: Any) -> None:
        self.published.append(key)
        self.waiting += 1

    async def declare(self, queue: Any, bindings: Any = ()) -> None:
        pass

    async def consume_raw(self, queue: str, callback: Any, *, prefetch: int) -> str:
        return "tag"

    def add_state_listener(self, listener: Callable[[bool], None]) -> None:
        self.listeners.append(listener)


@dataclass
class Shell:
    """Records what the leadership asked the scheduler to do."""

    events: list[str] = field(default_factory=list)
    fail_elect: bool = False

    async def elect(self) -> None:
        self.events.append("elect")
        if self.fail_elect:
            raise UnavailableError("message broker refused the publish")

    def depose(self, why: str) -> None:
        self.events.append(f"depose: {why}")


@dataclass
class ManualClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def make(clock: ManualClock | None = None) -> tuple[Leadership, FakeBroker, Shell]:
    broker, shell = FakeBroker(), Shell()
    lead = Leadership(
        cast(Broker, broker),
        "s1",
        shell.elect,
        shell.depose,
        renew_every=600.0,
        clock=clock or ManualClock(),
    )
    return lead, broker, shell


async def deliver(lead: Leadership, channel: object | None = None) -> FakeToken:
    token = FakeToken() if channel is None else FakeToken(channel=channel)
    await lead._on_token(cast(Any, token))
    await lead._step()
    return token


async def test_start_publishes_a_token_when_none_waits() -> None:
    lead, broker, _ = make()
    await lead.start()
    assert broker.published == [topology.SCHEDULER_LEADER_QUEUE]
    assert len(broker.listeners) == 1


async def test_start_publishes_nothing_when_a_token_waits() -> None:
    lead, broker, _ = make()
    broker.waiting = 1
    await lead.start()
    assert broker.published == []


async def test_a_token_makes_it_active_and_a_lost_connection_steps_it_down() -> None:
    lead, broker, shell = make()
    await deliver(lead)
    assert lead.active and shell.events == ["elect"]
    broker.healthy = False
    lead._on_connection_state(False)
    await lead._step()
    assert not lead.active
    assert shell.events[-1] == "depose: the scheduler lost its broker connection"
    await lead._step()  # still down: nothing more happens, no token is published
    assert len(shell.events) == 2 and broker.published == []


async def test_after_a_reconnect_the_redelivered_token_makes_it_active_again() -> None:
    lead, broker, shell = make()
    await deliver(lead)
    broker.healthy = False
    await lead._step()
    broker.healthy = True
    await deliver(lead)  # the restored consumer receives the requeued token
    assert lead.active
    assert shell.events == ["elect", "depose: the scheduler lost its broker connection", "elect"]


async def test_a_new_delivery_while_active_ends_the_old_leadership_first() -> None:
    lead, _, shell = make()
    await deliver(lead)
    await deliver(lead)  # the channel that held the first token was replaced
    assert lead.active
    assert shell.events == ["elect", "depose: the scheduler's broker channel was replaced", "elect"]


async def test_a_standby_that_sees_no_token_publishes_one_and_only_one() -> None:
    lead, broker, _ = make()
    await lead._step()  # e.g. the broker lost its data: no token anywhere
    await lead._step()  # the published one waits now: no second one
    assert broker.published == [topology.SCHEDULER_LEADER_QUEUE]


async def test_an_active_scheduler_publishes_no_token() -> None:
    lead, broker, _ = make()
    broker.waiting = 1
    await deliver(lead)
    broker.waiting = 0  # it holds the token
    await lead._step()
    assert broker.published == []


async def test_a_failed_election_gives_the_token_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leadership, "RETRY_SECONDS", 0.0)
    lead, _, shell = make()
    shell.fail_elect = True
    token = await deliver(lead)
    assert not lead.active
    assert token.rejected == [True]  # requeued, so it is delivered (and tried) again
    assert shell.events[-1].startswith("depose: could not take up the leadership")


async def renewing(clock: ManualClock) -> tuple[Leadership, FakeBroker, Shell, FakeToken]:
    """An active scheduler whose token is due for renewal and was just acked."""
    lead, broker, shell = make(clock)
    held = await deliver(lead)
    clock.now += 600.0
    await lead._step()
    return lead, broker, shell, held


async def test_renewal_acks_the_held_token_once_a_successor_waits() -> None:
    """RabbitMQ's consumer_timeout (30 min) would close the channel of a token held
    unacked for longer, deposing the leader: renewing hands it a fresh token first."""
    clock = ManualClock()
    lead, broker, shell, held = await renewing(clock)
    assert broker.published == [topology.SCHEDULER_LEADER_QUEUE]  # the successor
    assert held.acked == 1
    await deliver(lead, held.channel)  # the single active consumer receives it
    assert lead.active and lead.renewals == 1
    assert shell.events == ["elect"]  # one leadership throughout: nothing failed


async def test_renewal_is_not_due_before_its_time() -> None:
    clock = ManualClock()
    lead, broker, _ = make(clock)
    held = await deliver(lead)
    clock.now += 599.0
    await lead._step()
    assert held.acked == 0 and broker.published == []


async def test_leadership_renews_again_and_again() -> None:
    clock = ManualClock()
    lead, broker, shell, held = await renewing(clock)
    for _ in range(3):
        broker.waiting = 0  # the successor was delivered: none waits
        held = await deliver(lead, held.channel)
        clock.now += 600.0
        await lead._step()
        assert held.acked == 1
    assert lead.renewals == 3 and shell.events == ["elect"]


async def test_a_delivery_on_another_channel_while_renewing_is_a_new_leadership() -> None:
    clock = ManualClock()
    lead, _, shell, _ = await renewing(clock)
    await deliver(lead, object())  # the channel died meanwhile: a restored consumer's
    assert lead.active and lead.renewals == 0
    assert shell.events == ["elect", "depose: the scheduler's broker channel was replaced", "elect"]


async def test_a_successor_that_never_comes_ends_the_leadership() -> None:
    clock = ManualClock()
    lead, _, shell, _ = await renewing(clock)
    clock.now += leadership.RENEW_GRACE_SECONDS
    await lead._step()
    assert not lead.active
    assert shell.events[-1] == "depose: the renewed leadership token did not come back"
